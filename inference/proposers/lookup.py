"""Prompt lookup grafted onto another proposer's tree.

Trained heads are weakest exactly where prompt lookup is strongest: text the answer copies from
the prompt or repeats from itself (extraction, code, names, lists). Each step this wrapper looks
up the context's last n-gram like `ngram` does and merges the continuations that followed its
earlier occurrences into the inner proposer's tree, sharing the nodes where the two agree. The
target verifies both in the same forward, so a step accepts whichever path goes further.

It raised τ of every heads checkpoint measured here by 30-45% on MT-bench (README,
*Prompt lookup on heads' trees*; `specheads bench --methods eagle:DIR+lookup=0,eagle:DIR` compares).
The grafted drafts are deterministic, so the verifier treats them as one-hot and exactness holds
for greedy and sampling alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specheads.hub import looks_like_repo_id, resolve_heads
from specheads.inference.methods import option
from specheads.inference.node_budget import (
    NODE_BUDGET_HELP,
    NodeBudget,
    check_node_budget,
    node_budget,
    with_node_budget,
)
from specheads.inference.proposers.base import ProposalContext, Proposer, finish, fork, propose_rows
from specheads.inference.proposers.ngram import NgramConfig, NgramProposer
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult
from specheads.int8 import DRAFT_DTYPE_HELP, check_draft_dtype

# One continuation of up to 8 tokens, from the longest n-gram (3 down to 1) that matches. On the 2-core CPU
# this gave the most speed: deeper or more continuations raised τ further but cost more in the verify forward.
DEFAULT_LOOKUP = NgramConfig(min_ngram=1, num_candidates=1, depth=8, max_nodes=8)


class WithPromptLookup:
    """`inner`'s tree plus up to `config.num_candidates` prompt-lookup continuations."""

    def __init__(self, inner: Proposer, config: NgramConfig = DEFAULT_LOOKUP) -> None:
        self.inner = inner
        self.lookup = NgramProposer(config)
        self.needs_target_hidden = inner.needs_target_hidden

    @property
    def config(self) -> NgramConfig:
        return self.lookup.config

    def fork(self) -> WithPromptLookup:
        return WithPromptLookup(fork(self.inner), self.lookup.config)

    def finish(self) -> None:
        finish(self.inner)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.lookup.start(ctx, None)
        self.inner.start(ctx, target_hidden)

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return self.lookup.graft_onto(self.inner.propose(ctx), ctx)

    @staticmethod
    def propose_many(rows: Sequence[WithPromptLookup], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        trees = propose_rows([r.inner for r in rows], ctxs)
        return [r.lookup.graft_onto(t, c) for r, t, c in zip(rows, trees, ctxs)]

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.lookup.on_verified(result, None)
        self.inner.on_verified(result, target_hidden)


@dataclass(frozen=True, kw_only=True)
class HeadsOptions:
    """Options every method drafting from trained heads takes; a kind's options extend these."""

    heads: str | None = option("trained heads: a training run's final/ folder, a speculators or SGLang EAGLE-3 folder, "
                               "or a Hub repo id of one")
    lookup: int | None = option(f"prompt-lookup continuations grafted onto the heads' tree (default "
                                f"{DEFAULT_LOOKUP.num_candidates}; 0 = the heads alone)")
    node_budget: str | None = option(NODE_BUDGET_HELP)
    draft_dtype: str | None = option(DRAFT_DTYPE_HELP)

    def __post_init__(self) -> None:
        check_node_budget(self.node_budget)
        check_draft_dtype(self.draft_dtype)
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(f"--lookup must be >= 0 (prompt-lookup continuations grafted onto the tree; 0 turns it "
                             f"off), got {self.lookup}")
        if self.heads is not None and not Path(self.heads).is_dir():  # before any model loads
            if not looks_like_repo_id(self.heads):
                raise ValueError(f"heads folder {self.heads} does not exist; pass the final/ folder of a training run "
                                 "or a Hub repo id (ORG/NAME)")
            resolve_heads(self.heads)  # fetched (or found in the cache) now, so a bad id fails first


def with_heads_options(proposer: Proposer, target: PreTrainedModel, options: HeadsOptions,
                       budget: NodeBudget | None = None) -> Proposer:
    """`proposer` with prompt lookup grafted on and its trees pruned to the node budget, as `options` say
    (`budget`: one the proposer already consults while drafting)."""
    return with_node_budget(with_lookup(proposer, options.lookup), budget or node_budget(target, options.node_budget))


def with_lookup(proposer: Proposer, num_candidates: int | None) -> Proposer:
    """`proposer` with DEFAULT_LOOKUP grafted on (None), `num_candidates` continuations, or nothing (0)."""
    n = DEFAULT_LOOKUP.num_candidates if num_candidates is None else num_candidates
    if n == 0:
        return proposer
    return WithPromptLookup(proposer, replace(DEFAULT_LOOKUP, num_candidates=n, max_nodes=n * DEFAULT_LOOKUP.depth))

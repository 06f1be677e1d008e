"""Prompt lookup grafted onto another proposer's tree.

Trained heads are weakest exactly where prompt lookup is strongest: text the answer copies from
the prompt or repeats from itself (extraction, code, names, lists). Each step this wrapper looks
up the context's last n-gram like `ngram` does and merges the continuations that followed its
earlier occurrences into the inner proposer's tree, sharing the nodes where the two agree. The
target verifies both in the same forward, so a step accepts whichever path goes further.

It raises τ of heads checkpoints on MT-bench (docs/results.md; `specheads bench --methods
eagle:DIR+lookup=0,eagle:DIR` compares).
The grafted drafts are deterministic, so the verifier treats them as one-hot and exactness holds
for greedy and sampling alike.

`--graft suffix` grafts suffix decoding's tree instead (`suffix.py`): the continuations of the context's longest
suffix in the request and in the engine's cache of earlier answers, by how often each was followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.proposer import (
    ProposalContext,
    Proposer,
    finish,
    finished,
    fork,
    propose_rows,
    target_layers,
    verified_on,
)
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.options import (
    DEFAULT_LOOKUP,
    DEFAULT_SUFFIX_GRAFT,
    GRAFTS,
    HeadsOptions,
    NgramConfig,
    SuffixConfig,
)
from specheads.inference.proposers.ngram import NgramProposer
from specheads.inference.proposers.node_budget import NodeBudget, node_budget, with_node_budget
from specheads.inference.proposers.suffix import SuffixProposer


class WithPromptLookup:
    """`inner`'s tree plus what `lookup` grafts on: up to `config.num_candidates` prompt-lookup continuations (made
    from `config`), or suffix decoding's tree (a `SuffixProposer`)."""

    def __init__(self, inner: Proposer, config: NgramConfig = DEFAULT_LOOKUP,
                 lookup: NgramProposer | SuffixProposer | None = None) -> None:
        self.inner = inner
        self.lookup = lookup if lookup is not None else NgramProposer(config)
        self.needs_target_hidden = inner.needs_target_hidden
        self.target_layers = target_layers(inner)

    @property
    def config(self) -> NgramConfig | SuffixConfig:
        return self.lookup.config

    def verified_on(self, backend) -> None:
        verified_on(self.inner, backend)
        verified_on(self.lookup, backend)

    def fork(self) -> WithPromptLookup:  # suffix decoding's fork shares its cache of answers
        return WithPromptLookup(fork(self.inner), lookup=fork(self.lookup))

    def finish(self) -> None:
        finish(self.inner)

    def on_finished(self, tokens: torch.Tensor) -> None:
        finished(self.lookup, tokens)
        finished(self.inner, tokens)

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


def with_heads_options(proposer: Proposer, target: PreTrainedModel, options: HeadsOptions,
                       budget: NodeBudget | None = None) -> Proposer:
    """`proposer` with prompt lookup grafted on and its trees pruned to the node budget, as `options` say
    (`budget`: one the proposer already consults while drafting)."""
    return with_node_budget(with_lookup(proposer, options.lookup, options.graft, bool(options.isolate)),
                            budget or node_budget(target, options.node_budget))


def with_lookup(proposer: Proposer, num_candidates: int | None, graft: str | None = None,
                isolate: bool = False) -> Proposer:
    """`proposer` with DEFAULT_LOOKUP grafted on (None), `num_candidates` continuations, or nothing (0); with `graft`
    "suffix", suffix decoding's tree of DEFAULT_SUFFIX_GRAFT's nodes per continuation (`isolate`: from the request's
    own text only)."""
    n = DEFAULT_LOOKUP.num_candidates if num_candidates is None else num_candidates
    if n == 0:
        return proposer
    if (graft or GRAFTS[0]) == "suffix":
        config = replace(DEFAULT_SUFFIX_GRAFT, max_tree_nodes=n * DEFAULT_SUFFIX_GRAFT.max_tree_nodes, isolate=isolate)
        return WithPromptLookup(proposer, lookup=SuffixProposer(config))
    return WithPromptLookup(proposer, replace(DEFAULT_LOOKUP, num_candidates=n, max_nodes=n * DEFAULT_LOOKUP.depth))

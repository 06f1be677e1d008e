"""`suffix`: suffix decoding (SuffixDecoding, Oliaro et al., 2024; vLLM's `method: suffix`), training-free.

Each step matches the context's suffixes in two suffix trees (`suffix_tree.py`): the request's own prompt and
output, extended as tokens are committed, and the engine's cache of finished requests' answers (`suffix_cache.py`),
shared by every row (`fork` shares it), so by every request a server decodes. From each tree the match whose
continuations score best gives a draft: the continuations that followed the matched suffix, most frequent first, each
node's estimate the share of occurrences that went its way (times its parent's). Both drafts are merged into one tree;
the estimates are its `accept_probs`, so the node budget verifies the branches followed often and prunes the rest.
A draft holds at most `factor` nodes per matched token: a long match (repeated text) drafts a deep tree, a short one a
node or two. When nothing matches the tree is the root alone, a plain step.

With `isolate` a row drafts only from its own request's text: no cache of answers is read or kept.

The drafts are deterministic, so the verifier treats them as one-hot: exact under greedy and sampling. What a row
drafts depends on the answers finished before it, so a seeded sampled request reproduces given the same earlier
requests (its law never changes).

The suffix trees are ours, in Python: arctic-inference (Snowflake's implementation, which vLLM uses) ships only as a
source distribution whose build pulls torch and a C++ toolchain through CMake, with custom ops for vLLM beside the
suffix tree, far from the two-command set-up this project keeps. At the default sizes the Python trees cost little
beside a CPU verify forward (tens of milliseconds): on a busy 2-core CPU, with the cache full (16384 tokens, 290k
nodes, 23 MB) and a 1000-token prompt, a step's draft took 1.2 ms (median), starting the request 24 ms, and holding a
finished 256-token answer (evictions included) 29 ms.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.options import SuffixConfig
from specheads.inference.methods.suffix import SuffixOptions
from specheads.inference.proposers.node_budget import node_budget, with_node_budget
from specheads.inference.proposers.suffix_cache import SuffixCache
from specheads.inference.proposers.suffix_tree import DraftLimits, SuffixTree

_OWN = 0  # the request's sequence id in its own tree


class SuffixProposer:
    """Drafts from the request's text and the shared cache of finished answers (`cache`: given by `fork`, else made
    for `config`; None when isolated or sized 0)."""

    needs_target_hidden = False

    def __init__(self, config: SuffixConfig = SuffixConfig(), cache: SuffixCache | None = None) -> None:
        self.config = config
        if cache is None and config.shares:
            cache = SuffixCache(config.cache_tokens, config.tree_depth)
        self.cache = cache if config.shares else None
        self.limits = DraftLimits(max_nodes=config.max_tree_nodes, max_depth=config.max_depth, factor=config.factor,
                                  min_prob=config.min_prob, max_match=config.max_match)
        self._own: SuffixTree | None = None
        self._seen = 0  # context tokens in `_own`
        self._prompt = 0

    def fork(self) -> SuffixProposer:
        """Another row's proposer: its own text, the same cache of answers."""
        return SuffixProposer(self.config, self.cache)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._own, self._seen, self._prompt = None, 0, ctx.num_prompt_tokens
        self._catch_up(ctx.tokens)

    def _catch_up(self, tokens: torch.Tensor) -> None:
        """Add the tokens committed since the last draft (plain steps included) to the request's own tree."""
        if self._own is None:
            self._own = SuffixTree(self.config.tree_depth)
        self._own.extend(_OWN, tokens[self._seen:].tolist())
        self._seen = tokens.shape[0]

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return self.graft_onto(DraftTree.root_only(int(ctx.tokens[-1])), ctx)

    def graft_onto(self, tree: DraftTree, ctx: ProposalContext) -> DraftTree:
        """`tree` with this step's drafts merged in, the best-scoring first (up to `max_tree_nodes` new nodes)."""
        self._catch_up(ctx.tokens)
        depth = min(self.config.max_depth, ctx.max_depth)
        if depth < 1:
            return tree
        limits = replace(self.limits, max_depth=depth)
        context = ctx.tokens[-self.config.max_match:].tolist()
        drafts = [self._own.draft(context, limits)]
        if self.cache is not None:
            drafts.append(self.cache.draft(context, limits))
        paths: list[list[int]] = []
        probs: list[list[float]] = []
        for draft in sorted(drafts, key=lambda d: -d.score):  # stable: the request's own text first on a tie
            p, q = draft.paths()
            paths += p
            probs += q
        return tree.graft(paths, self.config.max_tree_nodes, probs)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        pass  # the committed tokens reach the request's tree at its next draft, from the context

    def on_finished(self, tokens: torch.Tensor) -> None:
        """Keep the answer, led by its prompt's last `max_match` tokens, for every later request."""
        if self.cache is not None:
            self.cache.add(tokens[max(self._prompt - self.config.max_match, 0):].tolist())
        self._own = None


def build(target, options: SuffixOptions, load_draft) -> Proposer:
    """The `suffix` method's proposer (`specheads.inference.methods.suffix`)."""
    return with_node_budget(SuffixProposer(options.config()), node_budget(target, options.node_budget))

"""`ngram`: prompt lookup over prompt + generated text, several continuations as one tree.

The last n tokens (n from max_ngram down to min_ngram) are looked up in the
context; the tokens that followed each earlier occurrence, most recent first,
become candidate continuations, merged into a trie (shared prefixes share nodes)
so all candidates are verified in one target forward. When nothing matches the
tree is just the root, i.e. a plain autoregressive step: no verify cost is paid
for an empty guess.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.ngram import NgramOptions
from specheads.inference.methods.options import NgramConfig
from specheads.inference.proposers.node_budget import node_budget, with_node_budget


def find_matches(tokens: torch.Tensor, cfg: NgramConfig, depth: int) -> list[tuple[int, list[int]]]:
    """Distinct continuations of the context's last n-gram, longest n first, most recent match first, each with
    the length n of the n-gram it continues.

    tokens [T] long (CPU). A continuation is up to `depth` tokens that followed an
    earlier occurrence of the last n tokens.
    """
    total = tokens.shape[0]
    found: list[tuple[int, list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(cfg.max_ngram, total - 1), cfg.min_ngram - 1, -1):
        tail = tokens[total - n :]
        windows = tokens[: total - 1].unfold(0, n, 1)  # [T-n, n]; excludes the tail itself
        starts = ((windows == tail).all(dim=1)).nonzero().squeeze(1) + n  # where continuations begin
        for start in starts.flip(0).tolist():
            cont = tokens[start : start + depth].tolist()
            key = tuple(cont)
            if not cont or key in seen or any(key == s[: len(key)] for s in seen):
                continue  # a prefix of a known continuation adds no node
            seen.add(key)
            found.append((n, cont))
            if len(found) == cfg.num_candidates:
                return found
    return found


class HitRates:
    """How often the target accepts a lookup continuation's tokens, per matched n-gram length and depth.

    Estimates P(token d accepted | tokens before it accepted) from the committed text: a continuation
    token counts as accepted when it equals the token the target committed at its position, whether
    or not it was verified (so pruned nodes are measured too); positions past the commit are unobserved.
    Each rate starts from `prior_hits` of `prior_seen`, so the first steps neither trust nor ignore lookup.
    """

    def __init__(self, max_ngram: int, depth: int, prior_hits: float = 1.0, prior_seen: float = 2.0) -> None:
        self.hits = torch.full((max_ngram + 1, depth), prior_hits, dtype=torch.float64)  # [n, d]
        self.seen = torch.full((max_ngram + 1, depth), prior_seen, dtype=torch.float64)  # [n, d]

    def path_probs(self, ngram: int, length: int) -> list[float]:
        """Probability that the first 1, 2, ..., length tokens of a continuation of an `ngram` match are accepted."""
        return (self.hits[ngram, :length] / self.seen[ngram, :length]).cumprod(0).tolist()

    def observe(self, ngram: int, continuation: list[int], committed: list[int]) -> None:
        for d, tok in enumerate(continuation[: min(len(committed), self.seen.shape[1])]):
            self.seen[ngram, d] += 1
            if tok != committed[d]:
                return
            self.hits[ngram, d] += 1



class NgramProposer:
    """Multi-candidate prompt lookup; deterministic drafts, so exact under greedy and sampling.

    Each node carries its estimated acceptance (`HitRates`, measured on the request so far), which a
    node budget uses to verify only the continuations worth their cost.
    """

    needs_target_hidden = False

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self.hit_rates = HitRates(config.max_ngram, config.depth)  # per request: acceptance is the text's
        self._proposed: list[tuple[int, list[int]]] = []  # this step's (n-gram length, continuation)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.hit_rates = HitRates(self.config.max_ngram, self.config.depth)
        self._proposed = []

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return self.graft_onto(DraftTree.root_only(int(ctx.tokens[-1])), ctx)

    def graft_onto(self, tree: DraftTree, ctx: ProposalContext) -> DraftTree:
        """`tree` with this step's continuations merged in (up to `max_nodes` new nodes)."""
        depth = min(self.config.depth, ctx.max_depth)
        self._proposed = find_matches(ctx.tokens, self.config, depth) if depth >= 1 else []
        probs = [self.hit_rates.path_probs(n, len(cont)) for n, cont in self._proposed]
        return tree.graft([cont for _, cont in self._proposed], self.config.max_nodes, probs)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        committed = result.tokens.tolist()
        for n, cont in self._proposed:
            self.hit_rates.observe(n, cont, committed)
        self._proposed = []  # observed once: the engine may verify plain steps without asking for a draft


def build(target, options: NgramOptions, load_draft) -> Proposer:
    """The `ngram` method's proposer (`specheads.inference.methods.ngram`)."""
    given = {"depth": options.depth, "num_candidates": options.width}
    proposer = NgramProposer(replace(NgramConfig(), **{k: v for k, v in given.items() if v is not None}))
    return with_node_budget(proposer, node_budget(target, options.node_budget))

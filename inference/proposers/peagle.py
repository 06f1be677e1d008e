"""`peagle`: P-EAGLE heads drafting a whole block in one head forward (`specheads.heads.peagle`).

EAGLE drafts level by level, one head forward per level. A P-EAGLE head reads, in one causal forward after the
committed pairs it has not seen, `depth - 1` mask entries, and gives a distribution for each of the next `depth`
tokens. The tree is built from those distributions (they do not depend on which token is chosen before them):
best-first over paths, a path's score being the sum of its tokens' draft log-probabilities, each node's children
being the `topk` best tokens of the next position, until the tree holds `total_tokens` nodes. A child never
scores above its parent, so every parent is taken before its children. The head cache keeps only the committed
pairs (the mask entries are never committed), in the rows EAGLE's proposer keeps (`HeadRows`), and rows draft
together: one head forward, one scoring GEMM for every row.

Drafts are deterministic top-k choices, so verification is exact for greedy and sampling alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from specheads.heads.peagle import KIND_NAME, PEagleHead
from specheads.inference.methods import Method, register_method
from specheads.inference.proposers.base import ProposalContext
from specheads.inference.proposers.eagle import (
    EAGLE_TREES,
    EagleOptions,
    EagleProposer,
    EagleTreeConfig,
    _scores,
    catch_up,
    tree_proposer,
)
from specheads.inference.proposers.eagle3 import HeadVocabulary
from specheads.inference.tree import DraftTree


class PEagleProposer(EagleProposer):
    """An EAGLE proposer whose head drafts a block per forward (`config.depth` <= the head's num_depths)."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return PEagleProposer.propose_many([self], [ctx])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(rows: Sequence[PEagleProposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """Every row's tree; rows sharing a head cache draft in one head forward (each row's tree is its lone one)."""
        trees: list[DraftTree | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for i, (p, ctx) in enumerate(zip(rows, ctxs)):
            assert p._row >= 0, "start() must be called before propose()"
            if p._pending is None or min(p.config.depth, ctx.max_depth) < 1:
                trees[i] = DraftTree.root_only(int(ctx.tokens[-1]))
            else:
                groups.setdefault(id(p._rows), []).append(i)
        for group in groups.values():
            for i, tree in zip(group, _draft_blocks([rows[i] for i in group], [ctxs[i] for i in group])):
                trees[i] = tree
        return trees


def _draft_blocks(rows: list[PEagleProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
    head: PEagleHead = rows[0].head
    depths = [min(p.config.depth, c.max_depth) for p, c in zip(rows, ctxs)]
    hidden = catch_up(rows, masks=max(depths) - 1, mask_entry=(head.mask_features(), head.config.mask_token_id))
    logp = _scores(rows, torch.stack(hidden))  # [B, K, C]
    return [block_tree(p.config, int(c.tokens[-1]), logp[b, :d], p.vocab.token_ids)
            for b, (p, c, d) in enumerate(zip(rows, ctxs, depths))]


def block_tree(config: EagleTreeConfig, root: int, logp: torch.Tensor, token_ids) -> DraftTree:
    """The best `total_tokens - 1` paths' nodes from per-position log-probabilities `logp` [K, C] (module doc); ties
    go to the earlier-found node. `token_ids` maps column indices to token ids."""
    top = logp.topk(min(config.topk, logp.shape[-1]), dim=-1)
    ids = token_ids(top.indices).cpu().tolist()  # [K][k]
    values = top.values.double().cpu().tolist()  # [K][k]
    depth, k = len(values), len(values[0])
    tokens, parents, scores = [root], [-1], [0.0]
    heap = [(-values[0][j], j, 0, 0, j) for j in range(k)]  # (-score, tie order, parent node, depth, choice)
    order = k
    while heap and len(tokens) < config.total_tokens:
        negative, _, parent, d, j = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][j])
        parents.append(parent)
        scores.append(-negative)
        if d + 1 < depth:
            for c in range(k):
                heapq.heappush(heap, (negative - values[d + 1][c], order, node, d + 1, c))
                order += 1
    probs = torch.tensor(scores, dtype=torch.float64).exp()
    if config.min_expected_accepted > 0 and float(probs[1:].sum()) < config.min_expected_accepted:
        return DraftTree.root_only(root)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), accept_probs=probs)


register_method(Method(
    name=KIND_NAME, summary="P-EAGLE heads drafting a block per forward, expanded into a tree, prompt lookup grafted on",
    options=EagleOptions,
    build=lambda target, options, load_draft: tree_proposer(target, options, KIND_NAME, HeadVocabulary, PEagleProposer),
    arg="heads", arg_hint="DIR", trees=EAGLE_TREES,
))

"""Block trees: the draft tree of a drafter that gives a distribution for each of the next K positions at once.

A block drafter (`peagle`'s mask entries, `dflash`'s masked block) yields per-position log-probabilities that do not
depend on which token is chosen before them. The tree is built from them best-first over paths, a path's score
being the sum of its tokens' draft log-probabilities, each node's children being the `topk` best tokens of the next
position, until the tree holds `total_tokens` nodes. A child never scores above its parent, so every parent is taken
before its children.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods.tree_options import TreeConfig


def block_tree(config: TreeConfig, root: int, logp: torch.Tensor,
               token_ids: Callable[[torch.Tensor], torch.Tensor]) -> DraftTree:
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

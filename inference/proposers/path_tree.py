"""Path trees: the draft tree of a drafter whose distribution at a position depends on the token chosen before it
(a block drafter with a Markov bias, `dspark`, or a candidate selector, `dflash2`), so each node's children come from
the distribution its own token conditions.

As block trees (`block_tree`) the tree is built best-first over paths, a path's score being the sum of its tokens'
draft log-probabilities, each node's children being the `topk` best tokens of its distribution, until the tree holds
`total_tokens` nodes. A node's distribution is computed when the node enters the tree (one `expand` call; none at
the last depth). A child never scores above its parent, so every parent is taken before its children.

The acceptance estimates (`accept_probs`, what the node budget weighs): where `expand` gives a confidence c, the
drafter's estimate that its best child is accepted, a child x of node n gets est(n) · c · q(x) / max q (siblings
scaled by their draft probability against the best one's); otherwise the path's draft probability exp(score).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import torch

from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods.tree_options import TreeConfig

# (node, its parent (-1 for the root), its token, its depth) -> the log-probabilities of its children's position [C]
# and the confidence that its best child is accepted (None: no estimate)
Expand = Callable[[int, int, int, int], tuple[torch.Tensor, float | None]]


def path_tree(config: TreeConfig, root: int, depth: int, expand: Expand,
              token_ids: Callable[[torch.Tensor], torch.Tensor]) -> DraftTree:
    """The best `total_tokens - 1` paths' nodes, `depth` levels deep at most (module doc); ties go to the
    earlier-found node. `token_ids` maps column indices to token ids."""
    tokens, parents, depths, scores, estimates = [root], [-1], [0], [0.0], [1.0]
    heap: list[tuple[float, int, int, int, float]] = []  # (-score, tie order, parent node, token, estimate)
    order = itertools.count()

    def open_children(node: int) -> None:
        logp, confidence = expand(node, parents[node], tokens[node], depths[node])
        top = logp.topk(min(config.topk, logp.shape[-1]))
        values = top.values.double().cpu().tolist()
        for value, token in zip(values, token_ids(top.indices).cpu().tolist()):
            score = scores[node] + value
            estimate = math.exp(score) if confidence is None else \
                estimates[node] * confidence * math.exp(value - values[0])
            heapq.heappush(heap, (-score, next(order), node, token, estimate))

    open_children(0)
    while heap and len(tokens) < config.total_tokens:
        negative, _, parent, token, estimate = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(-negative)
        estimates.append(estimate)
        if depths[-1] < depth:
            open_children(len(tokens) - 1)
    probs = torch.tensor(estimates, dtype=torch.float64)
    if config.min_expected_accepted > 0 and float(probs[1:].sum()) < config.min_expected_accepted:
        return DraftTree.root_only(root)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), accept_probs=probs)

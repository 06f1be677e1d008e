"""Static draft trees for heads that draft a fixed shape (Medusa), as lists of paths of top-k indices.

A path [i0, i1, ..., id] is the node reached by taking head 0's i0-th choice,
then head 1's i1-th choice, and so on: [0, 1] = head 0's top-1 followed by head 1's
second choice. A tree is parent-closed (every path's prefix is in it) and is kept
sorted by (length, path), which is breadth-first order: parents before children.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

Tree = list[list[int]]


def _typical_accuracies(num_heads: int = 4, top_k: int = 10) -> list[list[float]]:
    """Head k's i-th choice is right with probability 0.6 * 0.8**k / (i + 1)**2.

    Shaped after Medusa's measured head accuracies on Vicuna (head 0 top-1 about 0.6, each
    later head a little worse, most of the remaining mass on the next few choices). The
    exponent keeps each head's total at or below 1 (mutually exclusive choices); the
    numbers only order paths, so trees built from them are reasonable defaults, not tuned.
    """
    return [[0.6 * 0.8**k / (i + 1) ** 2 for i in range(top_k)] for k in range(num_heads)]


TYPICAL_ACCURACIES: list[list[float]] = _typical_accuracies()


def _check_accuracies(accuracies: Sequence[Sequence[float]]) -> None:
    if not accuracies or any(len(row) == 0 for row in accuracies):
        raise ValueError("accuracies must hold one non-empty row per head (accuracies[k][i] for head k's i-th choice)")
    bad = [(k, i, a) for k, row in enumerate(accuracies) for i, a in enumerate(row) if not 0.0 <= a <= 1.0]
    if bad:
        raise ValueError("accuracies are probabilities in [0, 1]; "
                         f"got head {bad[0][0]} choice {bad[0][1]} = {bad[0][2]}")


def path_value(path: Sequence[int], accuracies: Sequence[Sequence[float]]) -> float:
    """Probability that the whole path is accepted, if heads were independent."""
    value = 1.0
    for k, i in enumerate(path):
        if k >= len(accuracies) or i >= len(accuracies[k]):
            raise ValueError(f"path {list(path)} needs head {k} choice {i}, beyond the accuracies given "
                             f"({len(accuracies)} heads); measure more heads/choices or use a smaller tree")
        value *= accuracies[k][i]
    return value


def build_static_tree(accuracies: Sequence[Sequence[float]], num_nodes: int) -> Tree:
    """Medusa's greedy tree: the num_nodes paths with the largest expected acceptance.

    1. Start a max-heap with every depth-1 path [i], valued accuracies[0][i].
    2. Pop the highest-valued path and add it to the tree. A child's value is its
       parent's times an accuracy <= 1, so no child can beat its parent: popping in
       value order keeps the tree parent-closed.
    3. Push the popped path's children path + [j] (one per choice of the next head).
    4. Repeat until num_nodes paths; return them in breadth-first order.
    Ties break towards shorter, lower-index paths (the heap compares paths second).
    """
    _check_accuracies(accuracies)
    capacity, width = 0, 1
    for row in accuracies:
        width *= len(row)
        capacity += width
    if not 1 <= num_nodes <= capacity:
        raise ValueError(f"num_nodes must be in [1, {capacity}] for {len(accuracies)} heads with "
                         f"{[len(r) for r in accuracies]} choices, got {num_nodes}")
    heap: list[tuple[float, list[int]]] = [(-a, [i]) for i, a in enumerate(accuracies[0])]
    heapq.heapify(heap)
    tree: Tree = []
    while len(tree) < num_nodes:
        neg_value, path = heapq.heappop(heap)
        tree.append(path)
        depth = len(path)
        if depth < len(accuracies):
            for j, a in enumerate(accuracies[depth]):
                heapq.heappush(heap, (neg_value * a, path + [j]))
    return sorted(tree, key=lambda p: (len(p), p))


def expected_accept_length(tree: Sequence[Sequence[int]], accuracies: Sequence[Sequence[float]]) -> float:
    """The acceptance length tau a tree yields if heads were independent: 1 (bonus) + sum of path values.

    At each depth at most one of a node's children is the right token, so the expected number
    of accepted draft tokens is the sum over nodes of the probability their whole path is right.
    """
    _check_accuracies(accuracies)
    return 1.0 + math.fsum(path_value(p, accuracies) for p in validate_tree(tree))


def validate_tree(tree: Sequence[Sequence[int]]) -> Tree:
    """Check a tree is non-empty, duplicate-free and parent-closed; return it in breadth-first order."""
    if isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence) or len(tree) == 0:
        raise ValueError(f"a tree is a non-empty list of paths such as [[0], [1], [0, 0]], got {tree!r}")
    paths: Tree = []
    for p in tree:
        if (isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)):
            raise ValueError(f"tree path {p!r} must be a non-empty list of top-k indices (ints >= 0), e.g. [0, 1]")
        paths.append([int(i) for i in p])
    seen = {tuple(p) for p in paths}
    if len(seen) != len(paths):
        raise ValueError("the tree lists a path twice; remove the duplicate")
    for p in paths:
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree; add the parent path "
                             "(every prefix of a path must be in the tree)")
    return sorted(paths, key=lambda p: (len(p), p))


def tree_depth(tree: Sequence[Sequence[int]]) -> int:
    return max(len(p) for p in tree)


def prune_depth(tree: Sequence[Sequence[int]], max_depth: int) -> Tree:
    """The subtree of paths at most max_depth long (still parent-closed)."""
    return [list(p) for p in tree if len(p) <= max_depth]


def resolve_tree(spec: str | os.PathLike | Sequence[Sequence[int]], presets: Mapping[str, Tree] | None = None) -> Tree:
    """A tree from a preset name (a key of `presets`), a YAML/JSON file (a list of paths, or {"tree": [...]})
    or a list of paths."""
    presets = presets or {}
    if isinstance(spec, (str, os.PathLike)):
        name = os.fspath(spec)
        if name in presets:
            return [list(p) for p in presets[name]]
        file = Path(name)
        if not file.is_file():
            known = f"a preset ({', '.join(presets)}) or " if presets else ""
            raise ValueError(f"unknown tree {name!r}: use {known}a YAML/JSON file "
                             "holding a list of paths such as [[0], [1], [0, 0]]")
        try:
            data = yaml.safe_load(file.read_text(encoding="utf-8"))  # YAML is a superset of JSON
        except yaml.YAMLError as err:
            raise ValueError(f"tree file {file} is not valid YAML/JSON: {err}") from err
        if isinstance(data, dict) and "tree" in data:
            data = data["tree"]
        try:
            return validate_tree(data)
        except ValueError as err:
            raise ValueError(f"tree file {file}: {err}") from err
    return validate_tree(spec)

"""What shape of draft tree a tree-drafting method builds, and the options that pick it.

Every method that expands a head's distributions into a tree (the fused-head trees of `fused_tree`, the block
trees of `block_tree`) takes the same settings: how deep, how many children per node, how many nodes in all,
and when to skip drafting. `TREES` names the presets (`--tree NAME`, `METHOD:DIR@NAME` in bench), and
`TreeOptions` holds the command-line options of those methods.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specheads.inference.methods.options import HeadsOptions, option


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 5  # draft levels
    topk: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 12  # tree size including the root (bounds the verify cost)
    # Draft only when the tree's expected accepted tokens (Σ of node probabilities under the draft) reach this;
    # otherwise take a plain step. Worth it where a multi-token verify costs much more than a one-token step (CPU).
    min_expected_accepted: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 2:
            raise ValueError("a draft tree needs depth >= 1, topk >= 1 and total_tokens >= 2")


# Named trees. τ grows with the tree, and so does the verify forward; on a CPU every node adds GEMM work (the
# measured curve: `verify_cost`, docs/results.md), which is why the default is small.
TREES: dict[str, TreeConfig] = {
    "cpu": TreeConfig(),  # the default: depth 5, top-4, 12 nodes
    "wide": TreeConfig(depth=6, topk=8, total_tokens=32),
    "eagle2": TreeConfig(depth=6, topk=10, total_tokens=60),  # EAGLE-2's published GPU setting
}


# A chain of N draft tokens, one guess per position: what chain engines (llama.cpp, vLLM's EAGLE-3) draft, so its
# acceptance is what a drafter brings there. "chain" alone is a chain of 3 (llama.cpp's default --spec-draft-n-max).
_CHAIN = re.compile(r"chain([1-9][0-9]?)?")
CHAIN_LENGTH = 3


def named_tree(name: str | None) -> TreeConfig:
    """The named tree (None: the default), or `chainN`, a chain of N; an unknown name lists the known ones."""
    if name is None:
        return TreeConfig()
    if chain := _CHAIN.fullmatch(name):
        length = int(chain[1] or CHAIN_LENGTH)
        return TreeConfig(depth=length, topk=1, total_tokens=length + 1)
    if name not in TREES:
        raise ValueError(f"unknown tree {name!r}; use one of: {', '.join(TREES)}, or chainN (a chain of N draft "
                         "tokens; chain: 3) (or set --depth/--topk/--total-tokens)")
    return TREES[name]


def is_chain(name: str | None) -> bool:
    return name is not None and _CHAIN.fullmatch(name) is not None


@dataclass(frozen=True, kw_only=True)
class TreeOptions(HeadsOptions):
    tree: str | None = option(f"named tree: {', '.join(TREES)} (default cpu: depth 5, top-4, 12 nodes; wide 6/8/32; "
                              "eagle2 6/10/60), or chainN: a chain of N draft tokens, one guess per position, as "
                              "chain engines (llama.cpp, vLLM) draft (chain: 3); --depth/--topk/--total-tokens "
                              "override its fields")
    depth: int | None = option("draft levels")
    topk: int | None = option("children per expanded node")
    total_tokens: int | None = option("tree size including the root")
    min_expected_accepted: float | None = option("take a plain step when the draft expects fewer accepted tokens "
                                                 "(CPU: try 0.7)")
    def __post_init__(self) -> None:
        super().__post_init__()
        named_tree(self.tree)  # a bad name fails before anything loads


def tree_config(options: TreeOptions, depth: int) -> TreeConfig:
    """The tree `options` name (its preset, with --topk/--total-tokens/--min-expected-accepted over its fields),
    `depth` levels deep."""
    base = named_tree(options.tree)
    if is_chain(options.tree) and options.depth is None:  # the chain's own length (a block drafter's at most)
        depth = min(depth, base.depth)
    return TreeConfig(depth=depth, topk=options.topk or base.topk,
                      total_tokens=options.total_tokens or base.total_tokens,
                      min_expected_accepted=base.min_expected_accepted if options.min_expected_accepted is None
                      else options.min_expected_accepted)

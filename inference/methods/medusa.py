"""`medusa`: Medusa heads drafting a static tree, its named trees and options (built by
`specheads.inference.proposers.medusa`)."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import HeadsOptions, option
from specheads.static_trees import TYPICAL_ACCURACIES, Tree, build_static_tree, resolve_tree

# Named static trees (`--tree NAME`, `medusa:DIR@NAME` in bench); heads store the tree measured in training.
MEDUSA_TREES: dict[str, Tree] = {
    "chain-4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "medusa-16": build_static_tree(TYPICAL_ACCURACIES, 16),
    "medusa-32": build_static_tree(TYPICAL_ACCURACIES, 32),
    "medusa-63": build_static_tree(TYPICAL_ACCURACIES, 63),
}
DEFAULT_TREE = "medusa-16"


@dataclass(frozen=True, kw_only=True)
class MedusaOptions(HeadsOptions):
    tree: str | None = option(f"preset ({', '.join(MEDUSA_TREES)}) or a YAML/JSON file of paths (default: the "
                              f"tree stored with the heads, else {DEFAULT_TREE})")
    depth: int | None = option("prune the tree to this many levels")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree is not None:
            resolve_tree(self.tree, MEDUSA_TREES)  # a bad name or file fails before anything loads
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"the medusa tree depth must be >= 1, got {self.depth}")


METHOD = register_method(Method(
    name="medusa", summary="Medusa heads drafting a static top-k tree, prompt lookup grafted on",
    options=MedusaOptions, build="specheads.inference.proposers.medusa:build", arg="heads", arg_hint="DIR",
    trees=MEDUSA_TREES,
))

"""`ngram`: prompt lookup, its options (built by `specheads.inference.proposers.ngram`)."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import NODE_BUDGET_HELP, check_node_budget, option


@dataclass(frozen=True)
class NgramOptions:
    depth: int | None = option("tokens per continuation (default 5)")
    width: int | None = option("continuations merged into the tree (default 3)")
    node_budget: str | None = option(NODE_BUDGET_HELP)

    def __post_init__(self) -> None:
        check_node_budget(self.node_budget)


METHOD = register_method(Method(
    name="ngram", summary="prompt lookup: continuations of the context's last n-gram, verified as one tree",
    options=NgramOptions, build="specheads.inference.proposers.ngram:build",
))

"""`suffix`: suffix decoding, its settings and options (built by `specheads.inference.proposers.suffix`)."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import (
    ISOLATE_HELP,
    NODE_BUDGET_HELP,
    SuffixConfig,
    check_isolate,
    check_node_budget,
    option,
)


@dataclass(frozen=True)
class SuffixOptions:
    max_depth: int | None = option(f"draft levels (default {SuffixConfig.max_depth})")
    max_tree_nodes: int | None = option(f"drafted nodes per step (default {SuffixConfig.max_tree_nodes}), at most "
                                        "--factor per matched context token")
    factor: float | None = option(f"nodes drafted per matched context token (default {SuffixConfig.factor})")
    min_prob: float | None = option("least estimated probability of a drafted node: how often its continuation "
                                    f"followed the match (default {SuffixConfig.min_prob})")
    cache_tokens: int | None = option("tokens of finished requests' answers kept for every request, least recently "
                                      f"used evicted first (default {SuffixConfig.cache_tokens}; 0: none)")
    isolate: int | None = option(ISOLATE_HELP)
    node_budget: str | None = option(NODE_BUDGET_HELP)

    def __post_init__(self) -> None:
        check_node_budget(self.node_budget)
        check_isolate(self.isolate)
        self.config()  # a bad value fails before anything loads

    def config(self) -> SuffixConfig:
        given = {"max_depth": self.max_depth, "max_tree_nodes": self.max_tree_nodes, "factor": self.factor,
                 "min_prob": self.min_prob, "cache_tokens": self.cache_tokens,
                 "isolate": None if self.isolate is None else bool(self.isolate)}
        return SuffixConfig(**{k: v for k, v in given.items() if v is not None})


METHOD = register_method(Method(
    name="suffix", summary="suffix decoding: continuations of the context's longest suffix in the request and in "
                           "earlier answers, by how often each followed",
    options=SuffixOptions, build="specheads.inference.proposers.suffix:build",
))

"""The option dataclasses and settings several methods share, importable without torch.

A method's options are a frozen dataclass whose fields are made with `option(help)`: the command line derives
its flags and their help from them, and constructing the options validates them, so a bad value fails before
any model loads. The proposers import the settings from here (`node_budget`, `int8` drafting, prompt lookup).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads.hub import looks_like_repo_id, resolve_heads


def option(help: str, default: Any = None) -> Any:
    """A method option: a dataclass field whose help text documents its command-line flag."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NoOptions:
    """The options of a method that takes none."""


NODE_BUDGETS = ("auto", "fixed")  # the first is the default
NODE_BUDGET_HELP = (f"{', '.join(NODE_BUDGETS)}: per step verify only the drafted nodes worth their verify cost on "
                    "this machine (default; the cost curve is measured once, a few seconds, and cached), "
                    "or the whole tree")


def check_node_budget(choice: str | None) -> None:
    if choice is not None and choice not in NODE_BUDGETS:
        raise ValueError(f"unknown --node-budget {choice!r}; use one of: {', '.join(NODE_BUDGETS)}")


DRAFT_DTYPES = ("target", "int8")  # a drafter's weights: as loaded (the target's dtype) or int8
DRAFT_DTYPE_HELP = (f"{', '.join(DRAFT_DTYPES)}: the drafter's weights as loaded (default) or int8 "
                    "(CPU: drafting reads a quarter of the bytes; outputs stay exact)")


def check_draft_dtype(draft_dtype: str | None) -> None:
    if draft_dtype is not None and draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"unknown --draft-dtype {draft_dtype!r}; use one of: {', '.join(DRAFT_DTYPES)}")


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup's settings: the `ngram` method's, and those of the lookup grafted onto heads' trees."""

    max_ngram: int = 3
    min_ngram: int = 2  # 1-gram matches are mostly noise: their verify costs more than they win
    num_candidates: int = 3  # continuations merged into the tree
    depth: int = 5  # tokens per continuation
    max_nodes: int = 12  # draft nodes per tree (root excluded); bounds the verify cost

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_candidates < 1 or self.depth < 1 or self.max_nodes < 1:
            raise ValueError("num_candidates, depth and max_nodes must all be >= 1")


# One continuation of up to 8 tokens, from the longest n-gram (3 down to 1) that matches. On the 2-core CPU
# this gave the most speed: deeper or more continuations raised τ further but cost more in the verify forward.
DEFAULT_LOOKUP = NgramConfig(min_ngram=1, num_candidates=1, depth=8, max_nodes=8)


@dataclass(frozen=True, kw_only=True)
class HeadsOptions:
    """Options every method drafting from trained heads takes; a kind's options extend these."""

    heads: str | None = option("trained heads: a training run's final/ folder, a speculators or SGLang EAGLE-3 folder, "
                               "or a Hub repo id of one")
    lookup: int | None = option(f"prompt-lookup continuations grafted onto the heads' tree (default "
                                f"{DEFAULT_LOOKUP.num_candidates}; 0 = the heads alone)")
    node_budget: str | None = option(NODE_BUDGET_HELP)
    draft_dtype: str | None = option(DRAFT_DTYPE_HELP)

    def __post_init__(self) -> None:
        check_node_budget(self.node_budget)
        check_draft_dtype(self.draft_dtype)
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(f"--lookup must be >= 0 (prompt-lookup continuations grafted onto the tree; 0 turns it "
                             f"off), got {self.lookup}")
        if self.heads is not None and not Path(self.heads).is_dir():  # before any model loads
            if not looks_like_repo_id(self.heads):
                raise ValueError(f"heads folder {self.heads} does not exist; pass the final/ folder of a training run "
                                 "or a Hub repo id (ORG/NAME)")
            resolve_heads(self.heads)  # fetched (or found in the cache) now, so a bad id fails first

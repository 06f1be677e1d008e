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


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding's settings: the `suffix` method's, and those of the suffix tree grafted onto heads' trees."""

    max_depth: int = 8  # draft levels
    # Nodes per tree (root excluded), and at most `factor` per matched token: a long match drafts a big tree, a
    # one-token match one node (SuffixDecoding's adaptive size). The node budget then keeps what pays here.
    max_tree_nodes: int = 16
    factor: float = 1.0
    min_prob: float = 0.1  # drafted nodes' least estimated probability of being followed
    max_match: int = 16  # the longest suffix of the context matched (the trees are max_match + max_depth deep)
    cache_tokens: int = 16384  # finished answers held for every request (0: none)
    isolate: bool = False  # draft only from the request's own text: no answer of another request is read or kept

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_tree_nodes < 1 or self.max_match < 1:
            raise ValueError("suffix decoding needs max_depth, max_tree_nodes and max_match >= 1, got "
                             f"{self.max_depth}, {self.max_tree_nodes}, {self.max_match}")
        if not self.factor > 0:
            raise ValueError(f"--factor must be > 0 (nodes drafted per matched token), got {self.factor}")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"--min-prob must be in [0, 1], got {self.min_prob}")
        if self.cache_tokens < 0:
            raise ValueError(f"--cache-tokens must be >= 0 (0: no cache of finished answers), got {self.cache_tokens}")

    @property
    def tree_depth(self) -> int:
        """How deep the suffix trees are: a full-length match still has `max_depth` tokens to draft below it."""
        return self.max_match + self.max_depth

    @property
    def shares(self) -> bool:
        """Whether rows draft from a cache of other requests' answers."""
        return self.cache_tokens > 0 and not self.isolate


# Grafted onto heads' trees: one continuation's worth of nodes per `--lookup`, as prompt lookup's.
DEFAULT_SUFFIX_GRAFT = SuffixConfig(max_tree_nodes=8)


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding's settings (`lookahead` method): a Jacobi window of `window` columns and `ngram` - 1 levels
    in the verify forward, n-grams of `ngram` tokens in its pool, up to `candidates` of them verified per step. A
    verify forward carries (ngram - 1) * window - 1 window rows beside at most candidates * (ngram - 1) drafted
    nodes, and on a CPU every row adds to its cost (a 16-row forward cost 1.5-2.5 one-token steps on the 2-core CPUs
    measured): the defaults keep both small."""

    window: int = 4  # W: future positions guessed in parallel
    ngram: int = 3  # N: tokens per n-gram (the key token, then N - 1 drafted); the window keeps N - 1 levels
    candidates: int = 3  # G: n-grams of the pool verified per step
    prompt_pool: bool = True  # start the pool with the prompt's n-grams (repeated text drafts at once)
    # Run the window only beside n-grams of the pool whose estimated acceptance pays for the wide forward on this
    # machine, and take a plain step otherwise: on a CPU a forward of a few rows can cost twice a one-token step, so
    # the window rides along on forwards the drafts pay for rather than making every step a wide one
    # (docs/decoding.md measures both).
    lazy_window: bool = True

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"--window must be >= 1 (future positions in the Jacobi window), got {self.window}")
        if self.ngram < 3:
            raise ValueError(f"--ngram must be >= 3 (a key token and at least two drafted), got {self.ngram}")
        if self.candidates < 1:
            raise ValueError(f"--candidates must be >= 1 (pool n-grams verified per step), got {self.candidates}")
        if self.lazy_window and not self.prompt_pool:
            raise ValueError("--prompt-pool 0 needs --lazy-window 0: a lazy window runs only beside the pool's drafts, "
                             "so a pool started empty would never fill")

    @property
    def window_rows(self) -> int:
        """Rows the Jacobi window adds to a verify forward (its first level's first column is the tree's root)."""
        return (self.ngram - 1) * self.window - 1


ISOLATE_HELP = ("1: draft only from the request's own prompt and output, never from other requests' answers (no "
                "shared cache is read or kept: for tenants who must not see each other's text); default 0")


GRAFTS = ("ngram", "suffix")  # what heads methods graft onto their trees; the first is the default


def check_isolate(isolate: int | None) -> None:
    if isolate not in (None, 0, 1):
        raise ValueError(f"--isolate takes 0 or 1, got {isolate}")


@dataclass(frozen=True, kw_only=True)
class HeadsOptions:
    """Options every method drafting from trained heads takes; a kind's options extend these."""

    heads: str | None = option("trained heads: a training run's final/ folder, a speculators or SGLang EAGLE-3 folder, "
                               "or a Hub repo id of one")
    lookup: int | None = option(f"prompt-lookup continuations grafted onto the heads' tree (default "
                                f"{DEFAULT_LOOKUP.num_candidates}; 0 = the heads alone; with --graft suffix, "
                                f"{DEFAULT_SUFFIX_GRAFT.max_tree_nodes} suffix-tree nodes each)")
    graft: str | None = option(f"{', '.join(GRAFTS)}: what --lookup grafts onto the heads' tree: prompt lookup "
                               "(default) or suffix decoding's tree over the request and earlier answers")
    isolate: int | None = option(ISOLATE_HELP)
    node_budget: str | None = option(NODE_BUDGET_HELP)
    draft_dtype: str | None = option(DRAFT_DTYPE_HELP)

    def __post_init__(self) -> None:
        check_node_budget(self.node_budget)
        check_draft_dtype(self.draft_dtype)
        check_isolate(self.isolate)
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(f"--lookup must be >= 0 (prompt-lookup continuations grafted onto the tree; 0 turns it "
                             f"off), got {self.lookup}")
        if self.graft is not None and self.graft not in GRAFTS:
            raise ValueError(f"unknown --graft {self.graft!r}; use one of: {', '.join(GRAFTS)}")
        if self.isolate is not None and self.graft != "suffix":
            raise ValueError("--isolate applies to --graft suffix (prompt lookup reads only the request's own text)")
        if self.heads is not None and not Path(self.heads).is_dir():  # before any model loads
            if not looks_like_repo_id(self.heads):
                raise ValueError(f"heads folder {self.heads} does not exist; pass the final/ folder of a training run "
                                 "or a Hub repo id (ORG/NAME)")
            resolve_heads(self.heads)  # fetched (or found in the cache) now, so a bad id fails first

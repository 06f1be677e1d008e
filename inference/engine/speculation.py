"""How deep each row drafts, step by step: the engine's `Speculation` protocol and its two fixed policies.

The engine asks its policy before every step; `on` (the default) lets the proposer draft as deep as it likes and
`off` makes every step plain. The serving layer's measured policy (`specheads.inference.serve.adaptive`) decides
from a calibrated profile. Which tree is verified never changes which tokens are accepted: every policy is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult


class Speculation(Protocol):
    """The engine's per-step choice of how deep each row drafts. `start` is told of each row once, before its first
    draft; `depth` is asked before each of its steps (None: as deep as the proposer likes, 0: a plain step, d: at
    most d levels); `observe` sees each verified tree and its result, `batch` the rows in that step. `enabled` says
    whether steps of `batch` rows may draft at all (the server's `spec_decode_enabled`)."""

    def enabled(self, batch: int) -> bool: ...

    def start(self, row: RowState) -> None: ...

    def depth(self, row: RowState, batch: int) -> int | None: ...

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None: ...


@dataclass
class RowState:
    """What a speculation policy keeps per row (the engine holds one per sequence)."""

    tau: float = 0.0  # running τ of its speculative steps
    plain_left: int = 0  # plain steps before its next probe
    allowed: bool = False  # whether its current step may draft (the proposer may still draft nothing)


class AlwaysSpeculate:
    """`on`: every step drafts as deep as the proposer likes (the engine's default)."""

    def enabled(self, batch: int) -> bool:
        return True

    def start(self, row: RowState) -> None:
        pass

    def depth(self, row: RowState, batch: int) -> int | None:
        return None

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        pass


class NeverSpeculate(AlwaysSpeculate):
    """`off`: every step is plain (the proposer still follows the text, as it does between adaptive probes)."""

    def enabled(self, batch: int) -> bool:
        return False

    def depth(self, row: RowState, batch: int) -> int | None:
        return 0

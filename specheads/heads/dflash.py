"""DFlash block drafter (`specheads.heads.block_drafter`, laid out as vLLM's `speculators` package defines
`dflash`): the block is [x_n, mask, ..., mask] at positions n .. n+B-1, the anchor x_n being the last committed
token (the bonus token of the last verify), and slot j (1 <= j < B) drafts x_{n+j}, so one forward drafts B-1
tokens (speculators' `sample_from_anchor: false`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specheads.heads.block_drafter import BlockDrafterConfig, BlockDrafterHead, DraftBlock
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "dflash"


@dataclass(frozen=True, kw_only=True)
class DFlashBlock(DraftBlock):
    """What a DFlash drafter's block is: `DFlashConfig` and a dflash recipe's `heads:` section
    (`specheads.train.dflash`) both take it."""

    KIND: ClassVar[str] = KIND_NAME


@dataclass(frozen=True)
class DFlashConfig(BlockDrafterConfig, DFlashBlock):
    """What a DFlash drafter is; saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME


class DFlashHead(BlockDrafterHead):
    config: DFlashConfig


register_kind(DrafterKind(
    name=KIND_NAME, config=DFlashConfig, build=DFlashHead, module=DFlashHead,
    summary="DFlash block drafter: a few layers fed the target's hidden states as context keys and values, "
            "filling a block of masked positions in one forward (speculators' dflash layout)",
))

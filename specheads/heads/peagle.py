"""P-EAGLE head: an EAGLE-3 head that drafts a block of `num_depths` tokens in one forward, laid out as vLLM's
`speculators` package defines `peagle` (so it exports by renaming nothing but the config).

EAGLE-3 runs its head once per draft level, each run reading the previous one's output. P-EAGLE feeds the head,
after the last (feature, token) pair of the committed text at position t, `num_depths - 1` *mask* entries at
positions t+1, t+2, ...: the token `mask_token_id` and, in place of a target feature, one learned vector
`mask_hidden` (as wide as the fused aux states, so it goes through `fc` as they do). Under a causal mask the
entry at depth d sees the committed pairs and the masks before it, and predicts the token d places further on:

    pairs ... (h_t, x_{t+1})  ->  x_{t+2}                depth 0: exactly EAGLE-3's first draft step
    (mask_hidden, mask) at t+1 ->  x_{t+3}               depth 1
    (mask_hidden, mask) at t+2 ->  x_{t+4}               depth 2 ...

so one forward yields a distribution for each of the block's positions. Training samples the deeper positions
sparsely (conditional drop-token: depth d keeps a share r^d of the anchors, at least a floor) so a step costs
about one pass over the sequence (`specheads.train.peagle`).

The mask token's embedding is the target's (frozen, like every token's); `mask_hidden` is learned. The head is the
fused chain head EAGLE-3's is (`specheads.heads.fused_chain`), extended here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specheads.checked import Checked
from specheads.heads.fused_chain import FusedChainConfig, FusedChainHead
from specheads.heads.fused_head import MaskEntries, with_mask_token
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "peagle"


@dataclass(frozen=True, kw_only=True)
class PEagleBlock(MaskEntries, Checked):
    """What P-EAGLE adds to the fused chain head's settings, declared and checked here only: `PEagleConfig` and a
    peagle recipe's `heads:` section (`specheads.train.peagle`) both take them."""

    num_depths: int = 4  # tokens one forward drafts: the anchor's next token and num_depths - 1 masked positions

    def _check(self) -> None:
        if self.num_depths < 1:
            raise ValueError(f"peagle num_depths must be >= 1 (tokens drafted per forward; heads.num_depths in a "
                             f"recipe), got {self.num_depths}")


@dataclass(frozen=True)
class PEagleConfig(FusedChainConfig, PEagleBlock):
    """What a P-EAGLE head is: the EAGLE-3 layout's fused chain head plus its block settings; saved as its
    checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME


class PEagleHead(FusedChainHead):
    """The fused chain head (as `Eagle3Head`) plus the learned `mask_hidden` [1, 1, A*H] (A aux layers),
    speculators' parameter."""

    def __init__(self, config: PEagleConfig, target: nn.Module) -> None:
        config = with_mask_token(config, target)
        super().__init__(config, target)
        limit = getattr(self.layer_config, "max_position_embeddings", None)
        if limit is not None and config.num_depths >= limit:
            raise ValueError(f"peagle num_depths {config.num_depths} does not fit the target's context of {limit} "
                             "positions; use a block of a few tokens (4-8)")
        width = len(config.aux_layers) * config.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width, dtype=self.fc.weight.dtype,
                                                    device=self.fc.weight.device))

    def mask_features(self) -> torch.Tensor:  # [D]: a masked position's feature row (the last layer's columns unread)
        last = self.mask_hidden.new_zeros(self.config.hidden_size)
        return torch.cat([self.mask_hidden.reshape(-1), last])


register_kind(DrafterKind(
    name=KIND_NAME, config=PEagleConfig, build=PEagleHead, module=PEagleHead,
    summary="P-EAGLE heads: an EAGLE-3 head drafting a block of tokens in one forward from mask entries "
            "(speculators' peagle layout)",
))

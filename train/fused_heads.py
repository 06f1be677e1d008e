"""The `heads:` keys every recipe of a head that fuses target layers through `fc` shares (eagle3, peagle, dflash).

A kind's own settings (its block, its layout flags) come from the core's head config parts
(`specheads.heads.fused_chain.ChainLayout`, `specheads.heads.peagle.PEagleBlock`, ...), declared and validated once
there; a recipe's section class combines them with these and the objective's own settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.checked import Checked
from specheads.heads.fused_head import check_fused_layers, default_aux_layers
from specheads.train.divergence import HEAD_LOSSES


@dataclass(frozen=True)
class FusedHeadsConfig(Checked):
    """The `heads:` keys of every head that fuses target layers through `fc` (eagle3, peagle, dflash)."""

    num_layers: int = 1  # decoder layers in the head (eagle3's first reads cat(embedding, fused features))
    aux_layers: tuple[int, ...] | None = None  # target hidden_states fused by fc; None: 2, L//2, L-3 as speculators
    feature_noise: float = 0.0  # uniform noise of this amplitude on input features (regularisation)
    loss: str = "cross_entropy"  # against the target's distribution: cross_entropy or a divergence (divergence.py)

    def _check(self) -> None:
        object.__setattr__(self, "aux_layers", check_fused_layers(self.num_layers, self.aux_layers, "heads."))
        if self.feature_noise < 0:
            raise ValueError(f"heads.feature_noise must be >= 0, got {self.feature_noise}")
        if self.loss not in HEAD_LOSSES:
            raise ValueError(f"heads.loss {self.loss!r} is unknown; use one of: {', '.join(HEAD_LOSSES)}")

    def resolved_aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return self.aux_layers if self.aux_layers is not None else default_aux_layers(num_target_layers)

    def head_fields(self, target: torch.nn.Module, draft_vocab: list[int] | None) -> dict:
        """The head config's fields these settings and the target fix (those every fused-layer head config has)."""
        tcfg = target.config.get_text_config()
        return {"hidden_size": tcfg.hidden_size, "vocab_size": target.get_output_embeddings().weight.shape[0],
                "aux_layers": self.resolved_aux_layers(tcfg.num_hidden_layers), "num_layers": self.num_layers,
                "draft_vocab": None if draft_vocab is None else tuple(draft_vocab)}

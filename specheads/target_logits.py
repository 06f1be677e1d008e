"""What a target does to its LM head's output before it is a distribution.

Most decoders' logits are their LM head's output. Some families change it: Granite divides by `logits_scaling`,
Cohere multiplies by `logit_scale`, Gemma 2 and 3 soft-cap with `final_logit_softcapping` (c * tanh(x / c)).
A drafter trained or drafting against "the target's distribution" must use the same logits, or it learns
another law (a Granite target read without its scaling is several times sharper than it is).

Heads that reuse the target's LM head (EAGLE-1, shared Medusa heads) apply the whole map. Heads with LM heads of
their own (EAGLE-3, P-EAGLE, DFlash, Medusa with `own_lm_head`) start from the target's rows times its scale; the
soft cap is not folded in: such a head runs as a plain LM head in every engine that loads its export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LogitMap:
    """logits = softcap(scale * lm_head(h)), softcap(x) = c * tanh(x / c) when `softcap` is set."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_map(config: Any) -> LogitMap:
    """The map of a target's config (a multimodal config's text config is read)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(text, "logits_scaling", None):  # Granite
        scale /= float(text.logits_scaling)
    if getattr(text, "logit_scale", None) is not None:  # Cohere
        scale *= float(text.logit_scale)
    softcap = getattr(text, "final_logit_softcapping", None)
    return LogitMap(scale=scale, softcap=float(softcap) if softcap else None)


def target_draft_weight(target: nn.Module, draft_ids: torch.Tensor | None) -> torch.Tensor:  # [Vd, H]
    """The target's LM head rows of a draft vocabulary (all rows when `draft_ids` is None)."""
    weight = target.get_output_embeddings().weight
    return weight if draft_ids is None else weight[draft_ids.to(weight.device)]


def target_draft_logits(target: nn.Module, hidden: torch.Tensor,  # [..., H] what the target's LM head reads
                        draft_ids: torch.Tensor | None = None) -> torch.Tensor:  # [..., Vd]
    """The target's own logits over a draft vocabulary, as its forward computes them from its last hidden state."""
    head = target.get_output_embeddings()
    weight = target_draft_weight(target, draft_ids)
    logits = hidden.to(weight.dtype) @ weight.T
    bias = getattr(head, "bias", None)
    if bias is not None:
        logits = logits + (bias if draft_ids is None else bias[draft_ids.to(bias.device)])
    return logit_map(target.config)(logits)

"""Target features for drafter training, computed online inside the training step (no grad)."""

from __future__ import annotations

import torch
from torch import nn

from specheads.hf import decoder_of


def batch_features(target: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # [B, T, H]
    """Features from the batch when they were cached offline, else computed by the target now."""
    if "features" in batch:
        return batch["features"].to(next(target.parameters()).dtype)
    return target_features(target, batch["input_ids"], batch["attention_mask"])


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B, T, H] the target's last hidden state, after the final norm (what its LM head reads)
    """Run the frozen target's decoder stack only: the full-vocabulary logits are never materialised here."""
    out = decoder_of(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state

"""Target features for drafter training: the frozen target's hidden states, computed online inside
the training step (no grad) or read from the offline cache.

A feature row is cat(aux layers..., last layer) (`specheads.features.feature_rows`, the layout
proposers read at decode time); the last H columns are always the last hidden state after
the final norm (what the LM head reads), so every objective finds it in the same place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specheads.features import feature_rows, feature_width
from specheads.hf import decoder_of


def batch_features(target: nn.Module, batch: dict[str, torch.Tensor], aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """[B, T, D] features from the batch when they were cached offline, else computed by the target now.

    A cache holding aux layers also serves a run that wants only the last layer (its last H columns)."""
    if "features" not in batch:
        return target_features(target, batch["input_ids"], batch["attention_mask"], aux_layers)
    feats = batch["features"].to(next(target.parameters()).dtype)
    hidden = target.config.get_text_config().hidden_size
    if feats.shape[-1] == feature_width(hidden, aux_layers):
        return feats
    if not aux_layers:
        return last_layer(feats, hidden)
    raise ValueError(f"the feature cache holds {feats.shape[-1] // hidden} layer(s) per token but the heads read "
                     f"{len(aux_layers) + 1}; rebuild it (a new feature_cache_dir) with these heads.aux_layers")


def last_layer(features: torch.Tensor, hidden_size: int) -> torch.Tensor:  # [..., D] -> [..., H]
    return features[..., -hidden_size:]


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T]
    aux_layers: Sequence[int] = (),
) -> torch.Tensor:  # [B, T, D]: cat(hidden_states[aux]..., last hidden state after the final norm)
    """Run the frozen target's decoder stack only: the full-vocabulary logits are never materialised here."""
    out = decoder_of(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                             output_hidden_states=bool(aux_layers))
    return feature_rows(out.hidden_states, aux_layers) if aux_layers else out.last_hidden_state

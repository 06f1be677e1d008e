"""The target features a drafter reads: one row per token, the same layout in training and decoding.

A feature row is cat(hidden_states[i] for i in aux_layers, last hidden state), D = (len(aux_layers) + 1) * H.
HF `hidden_states` holds the embeddings first and, last, the state after the final norm (what the LM
head reads), so the last H columns of a row are always that state, whatever the aux layers. Online
training features, the offline feature cache and the decode-time proposers all build rows here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def feature_width(hidden_size: int, aux_layers: Sequence[int]) -> int:  # D = (len(aux_layers) + 1) * H
    return (len(aux_layers) + 1) * hidden_size


def feature_rows(hidden_states: Sequence[torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor:  # -> [..., D]
    """cat(aux layers..., last) from a forward's `hidden_states`; the last entry alone without aux layers."""
    if not aux_layers:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in aux_layers] + [hidden_states[-1]], dim=-1)


def feature_layers(aux_layers: Sequence[int]) -> tuple[int, ...]:
    """The hidden_states indices `feature_rows` reads: the aux layers and the last (-1)."""
    return (*aux_layers, -1)


def check_aux_layers(aux_layers: Sequence[int], num_target_layers: int) -> None:
    """Aux layers index the target's hidden_states strictly between the embeddings and the last layer."""
    if list(aux_layers) != sorted(set(aux_layers)) or any(not 0 < i < num_target_layers for i in aux_layers):
        raise ValueError(f"aux_layers must be sorted, distinct hidden_states indices in [1, {num_target_layers - 1}] "
                         f"for a {num_target_layers}-layer target (EAGLE-3 uses 2, L//2, L-3), got {list(aux_layers)}")

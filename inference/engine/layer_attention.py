"""Which attention each of a target's layers does, and the masks a forward hands them.

Full attention: a query at position p sees every key its mask allows. Sliding-window attention (Mistral with a
window, Gemma 2/3's local layers, gpt-oss's alternate layers, EXAONE 4): it sees keys at positions > p - window only,
as transformers' own masks define it. The engine's caches keep every key of every layer, sliding ones included: a
rolling buffer would have dropped keys that a rejected branch's rollback needs again, while a full buffer rolls back
by moving a row's length. The window is applied in the mask instead, per layer type: a model whose layers all
attend alike takes one 4-D mask, a hybrid one (local and global layers) a {layer type: mask} mapping, which is how
transformers' hybrid models take their masks.

Layer types other than full and sliding (linear attention, state-space layers, chunked attention) keep state that
a tree cannot branch, and are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerAttention:
    """The layer types of a model and each one's window (None: full attention)."""

    windows: tuple[tuple[str, int | None], ...]  # (layer type, window), one per type present, in first-use order

    @property
    def windowed(self) -> bool:
        """Some layers see a sliding window: every forward needs the engine's masks, chains included."""
        return any(window is not None for _, window in self.windows)

    def masks(
        self,
        visible: torch.Tensor,  # [B, W, S] bool: query i of row b may see key slot s (causality, tree ancestry)
        query_positions: torch.Tensor | None,  # [B, W] long: each query's position (needed when windowed)
        key_positions: torch.Tensor | None,  # [B, S] long: the position each key slot holds (needed when windowed)
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | dict[str, torch.Tensor]:  # [B, 1, W, S] additive, or one per layer type
        """The additive mask(s) of a forward: `visible`, and for sliding layers only the keys within the window."""
        if not self.windowed:
            return additive_mask(visible, dtype, device)
        assert query_positions is not None and key_positions is not None
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [B, W, S]
        per_type = {kind: additive_mask(visible if window is None else visible & (distance < window), dtype, device)
                    for kind, window in self.windows}
        return next(iter(per_type.values())) if len(per_type) == 1 else per_type


FULL_ONLY = LayerAttention(((FULL, None),))


def layer_attention(config: PretrainedConfig) -> LayerAttention:
    """The attention of `config`'s layers: its `layer_types` when it lists them, else a sliding window in every
    layer when it sets `sliding_window` (Mistral and Phi-3 decide so), else full attention."""
    cfg = config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [SLIDING if window is not None else FULL])
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        raise ValueError(f"{cfg.model_type} has {', '.join(other)} layers, whose state a draft tree cannot branch "
                         "and roll back; the engine verifies models whose layers use full or sliding-window "
                         "attention (HF `generate` decodes this model without speculation)")
    if SLIDING in types and not window:
        raise ValueError(f"{cfg.model_type} has sliding-window layers but its config sets no sliding_window; "
                         "set it to the window the model was trained with")
    return LayerAttention(tuple((kind, window if kind == SLIDING else None) for kind in dict.fromkeys(types)))


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, W, S] bool (query sees key) -> [B, 1, W, S] additive attention mask."""
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None].to(device)

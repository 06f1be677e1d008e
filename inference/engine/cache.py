"""KV cache with tree commit, for HF causal LMs.

A `DynamicCache` whose layers write into preallocated buffers that grow by
doubling, instead of concatenating on every forward. After a verify forward the
cache holds the committed prefix followed by one entry per tree node; `commit`
keeps only the accepted path's entries (gathered right after the prefix) and
drops the rest. Nothing is ever re-prefilled.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specheads.hf import cache_kwargs  # noqa: F401  (re-exported: the engine's entry point for it)
from specheads.inference.engine.layer_attention import layer_attention


def grown(buf: torch.Tensor, needed: int, keep: int) -> torch.Tensor:
    """`buf` [B, H, C, D], or a copy with at least `needed` slots (doubling) holding its first `keep` entries and
    zeros after them: a batch's masked slots are read by attention (with weight 0), so they must hold no NaN."""
    if needed <= buf.shape[2]:
        return buf
    new = buf.new_zeros(buf.shape[0], buf.shape[1], max(needed, 2 * buf.shape[2]), buf.shape[3])
    new[:, :, :keep] = buf[:, :, :keep]
    return new


def check_full_length_layers(config: PretrainedConfig, layers: list) -> None:
    """Fail by name unless `layers` (a DynamicCache's, one per model layer) are ones the engine's full-length layers
    can replace: full attention, or a sliding window (kept whole, the window applied in the mask:
    `layer_attention.py`)."""
    layer_attention(config)  # other layer types are refused by name
    unsupported = sorted({type(layer).__name__ for layer in layers
                          if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if unsupported:
        raise ValueError(f"{config.get_text_config().model_type} uses cache layers {unsupported}, which tree "
                         "verification cannot roll back; use a model with full or sliding-window attention")


class _GrowableLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views into a larger buffer."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._capacity = max(capacity, 16)
        self._length = 0
        self._kbuf: torch.Tensor | None = None  # [B, H, C, D]
        self._vbuf: torch.Tensor | None = None  # [B, H, C, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty(b, h, self._capacity, d)
        self._vbuf = value_states.new_empty(b, h, self._capacity, value_states.shape[-1])
        self.is_initialized = True

    def _ensure(self, needed: int) -> None:
        self._kbuf, self._vbuf = (grown(buf, needed, self._length) for buf in (self._kbuf, self._vbuf))

    def _refresh_views(self) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        self.keys = self._kbuf[:, :, : self._length]
        self.values = self._vbuf[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._ensure(self._length + n)
        self._kbuf[:, :, self._length : self._length + n] = key_states
        self._vbuf[:, :, self._length : self._length + n] = value_states
        self._length += n
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        assert tokens_to_remove <= 0
        self.truncate(self._length + tokens_to_remove)

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self._length, (length, self._length)
        self._length = length
        if self.is_initialized:
            self._refresh_views()

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Move entries start+index to start..start+len(index), then drop everything after."""
        if self.is_initialized and index.numel():
            src = index.to(self._kbuf.device) + start
            self._kbuf[:, :, start : start + index.numel()] = self._kbuf.index_select(2, src)
            self._vbuf[:, :, start : start + index.numel()] = self._vbuf.index_select(2, src)
        self.truncate(start + index.numel())


class TreeKVCache(DynamicCache):
    """The target's (or a draft model's) KV cache, committed to an accepted tree path."""

    def __init__(self, config: PretrainedConfig, capacity: int = 1024) -> None:
        super().__init__(config=config)
        check_full_length_layers(config, self.layers)
        self.layers = [_GrowableLayer(capacity) for _ in self.layers]

    def __len__(self) -> int:  # number of layers, as DynamicCache defines it
        return len(self.layers)

    @property
    def seq_length(self) -> int:
        return self.get_seq_length()

    def commit(self, prefix_length: int, keep: torch.Tensor) -> None:
        """Keep entries prefix_length + keep (node indices, in order) right after the prefix; drop the rest.

        keep [K] long: for a verify forward over tree nodes, the accepted path's node indices.
        A path that is already in place (0, 1, ..., K-1: plain steps, chains) only truncates.
        """
        n = keep.numel()
        if keep.device.type == "cpu" and torch.equal(keep, torch.arange(n)):
            self.truncate(prefix_length + n)
            return
        for layer in self.layers:
            layer.keep(prefix_length, keep)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

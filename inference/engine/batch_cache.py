"""KV cache for a batch of sequences of different lengths, each committed to its own accepted tree path.

Sequences live in rows of preallocated buffers ([rows, kv heads, capacity, head dim] per layer, grown by doubling);
row r holds `lengths[r]` committed entries. A forward runs over a contiguous range of rows (all running sequences
for a verify step, one row for a newcomer's prefill) with every row's input padded to the same width W: row r's W
new entries are written right after its own committed prefix, at [lengths[r], lengths[r] + W), and attention reads
[0, max(lengths) + W) under a 4-D mask (`batch_tree_mask`) that shows row r's query only its own prefix and its
own tree ancestors. Slots past a row's length hold stale entries from earlier steps; the mask hides them, and later
writes overwrite them.

Keeping the running rows contiguous (a finished row's slot is refilled by moving the last row into it: one copy of
that row's entries) lets every forward read plain views of the buffers, never a gathered copy.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from specheads.inference.engine.cache import check_full_length_layers, grown
from specheads.inference.engine.layer_attention import FULL_ONLY, LayerAttention, additive_mask
from specheads.inference.engine.tree import DraftTree


class _RowsLayer(DynamicLayer):
    def __init__(self, rows: int, capacity: int, owner: BatchKVCache) -> None:
        super().__init__()
        self._rows, self._capacity, self._owner = rows, max(capacity, 16), owner
        self._kbuf: torch.Tensor | None = None  # [R, H, C, D]
        self._vbuf: torch.Tensor | None = None  # [R, H, C, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        _, h, _, d = key_states.shape
        self._kbuf = key_states.new_zeros(self._rows, h, self._capacity, d)
        self._vbuf = value_states.new_zeros(self._rows, h, self._capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = self.write(key_states, value_states)
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor,
              span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the window rows' new entries [B, H, W, D], each right after its row's prefix; return the window's
        keys and values [B, H, S, D] over S = `span` slots (default: the longest prefix plus W, the least that holds
        them; a larger span adds slots the mask must hide)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, lengths = self._owner.window_rows, self._owner.lengths
        width = key_states.shape[2]
        rows = range(first, first + key_states.shape[0])
        end = max(lengths[r] for r in rows) + width
        assert span is None or span >= end, (span, end)
        end = span or end
        # every row keeps its entries (the longest prefix bounds them; stale slots past a row's length are masked)
        self._kbuf, self._vbuf = (grown(buf, end, max(lengths, default=0)) for buf in (self._kbuf, self._vbuf))
        for i, r in enumerate(rows):  # each row's new entries right after its own prefix
            self._kbuf[r, :, lengths[r] : lengths[r] + width] = key_states[i]
            self._vbuf[r, :, lengths[r] : lengths[r] + width] = value_states[i]
        return self._kbuf[rows.start : rows.stop, :, :end], self._vbuf[rows.start : rows.stop, :, :end]

    def committed(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window rows' first `span` slots [B, H, span, D] of keys and values (`span` at least the longest
        prefix; slots past a row's length hold stale or zero entries the mask must hide), growing the buffers to
        hold them."""
        first, count = self._owner.window_rows, self._owner.window_count
        self._kbuf, self._vbuf = (grown(buf, span, max(self._owner.lengths, default=0))
                                  for buf in (self._kbuf, self._vbuf))
        return self._kbuf[first : first + count, :, :span], self._vbuf[first : first + count, :, :span]

    def get_seq_length(self) -> int:  # the longest prefix in the next forward's rows (HF sizes its masks by it)
        return max(self._owner.window_lengths(), default=0)

    def keep(self, row: int, start: int, index: torch.Tensor) -> None:
        """Move row `row`'s entries start+index to start..start+len(index)."""
        if self.is_initialized and index.numel():
            src = index.to(self._kbuf.device) + start
            for buf in (self._kbuf, self._vbuf):
                buf[row, :, start : start + index.numel()] = buf[row].index_select(1, src)

    def grow_rows(self, rows: int) -> None:
        if self.is_initialized and rows > self._kbuf.shape[0]:
            self._kbuf, self._vbuf = (torch.cat([buf, buf.new_zeros(rows - buf.shape[0], *buf.shape[1:])])
                                      for buf in (self._kbuf, self._vbuf))
        self._rows = max(self._rows, rows)

    def move(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized and length:
            for buf in (self._kbuf, self._vbuf):
                buf[dst, :, :length] = buf[src, :, :length]


class BatchKVCache(DynamicCache):
    """The target's KV cache for up to `rows` sequences at once (see the module doc); with `grow_rows`, `rows` is where
    it starts, and it doubles when a row is added to a full cache."""

    def __init__(self, config: PretrainedConfig, rows: int, capacity: int = 1024, grow_rows: bool = False) -> None:
        super().__init__(config=config)
        check_full_length_layers(config, self.layers)
        self.layers = [_RowsLayer(rows, capacity, self) for _ in self.layers]
        self.rows = rows
        self.grows = grow_rows
        self.lengths: list[int] = []  # committed entries of each occupied row; rows 0..len-1 are occupied
        self.window_rows, self.window_count = 0, 0  # the rows the next forward covers

    def __len__(self) -> int:  # number of layers, as DynamicCache defines it
        return len(self.layers)

    def add_row(self) -> int:
        """Occupy the next free row (empty); returns its index."""
        if len(self.lengths) == self.rows:
            if not self.grows:
                raise ValueError(f"all {self.rows} rows are occupied")
            self.rows *= 2
            for layer in self.layers:
                layer.grow_rows(self.rows)
        self.lengths.append(0)
        return len(self.lengths) - 1

    def remove_row(self, row: int) -> int | None:
        """Free `row`; the last row moves into it to keep rows contiguous. Returns the moved row's old index (now
        `row`), or None when `row` was the last."""
        last = len(self.lengths) - 1
        if row == last:
            self.lengths.pop()
            return None
        for layer in self.layers:
            layer.move(last, row, self.lengths[last])
        self.lengths[row] = self.lengths.pop()
        return last

    def window(self, first_row: int, count: int) -> BatchKVCache:
        """Make the next forward cover rows first_row .. first_row + count - 1 (its inputs' batch, in order)."""
        self.window_rows, self.window_count = first_row, count
        return self

    def window_lengths(self) -> list[int]:
        return self.lengths[self.window_rows : self.window_rows + self.window_count]

    def commit(self, row: int, keep: torch.Tensor) -> None:
        """After a forward that wrote W entries into `row`, keep those at `keep` (node indices, in order) right
        after its prefix: the row's accepted path, or 0..P-1 for a prefill of P tokens."""
        n = keep.numel()
        if not (keep.device.type == "cpu" and torch.equal(keep, torch.arange(n))):
            for layer in self.layers:
                layer.keep(row, self.lengths[row], keep)
        self.lengths[row] += n


def batch_tree_mask(trees: list[DraftTree], lengths: list[int], dtype: torch.dtype, device: torch.device,
                    span: int | None = None, attention: LayerAttention = FULL_ONLY,
                    ) -> torch.Tensor | dict[str, torch.Tensor]:  # [B, 1, W, span or max(lengths) + W] additive
    """Row b's query i sees keys [0, lengths[b]) (its committed prefix) and its tree's ancestors of node i (itself
    included) at lengths[b] + j; nothing else: not other rows' longer prefixes, not stale slots, not padding, not
    the slots a longer `span` adds. Padding queries (i >= the row's tree size) see only their own slot, so their
    softmax stays finite. Sliding-window layers (`attention`) see only the keys within their window; one mask per
    layer type when the model's layers differ. A tree's extra rows (`extra_rows.py`) follow its nodes, seeing what its
    `input_visible` marks."""
    width = max(t.input_size for t in trees)
    total = span or max(lengths) + width
    new, real = _new_entries_visible(trees, width)
    visible = torch.zeros(len(trees), width, total, dtype=torch.bool)
    for b, length in enumerate(lengths):
        visible[b, :, :length] = real[b, :, None]
        visible[b, :, length : length + width] = new[b]
    if not attention.windowed:
        return additive_mask(visible, dtype, device)
    queries = torch.tensor(lengths)[:, None].repeat(1, width)  # [B, W]: padding queries sit at the row's length
    keys = torch.arange(total).repeat(len(trees), 1)  # [B, S]: a committed slot holds its own position
    for b, (tree, length) in enumerate(zip(trees, lengths)):
        queries[b, : tree.input_size] += tree.input_depths.cpu()
        keys[b, length : length + width] = queries[b]  # node j's entry holds node j's position
    return attention.masks(visible, queries, keys, dtype, device)


def causal_mask(lengths: list[int], width: int, span: int, dtype: torch.dtype, device: torch.device,
                attention: LayerAttention = FULL_ONLY) -> torch.Tensor | dict[str, torch.Tensor]:  # [B, 1, W, span]
    """Row b's query i sees its prefix and its inputs 0..i (a chain: a prefill, or plain decoding) in a window of
    `span` slots (sliding-window layers: only the keys within their window)."""
    keys = torch.arange(span)  # every slot holds its own position
    limit = torch.tensor(lengths)[:, None] + torch.arange(width)  # [B, W]: the last slot each query sees
    return attention.masks(keys <= limit[..., None], limit, keys.expand(len(lengths), span), dtype, device)


def committed_then_new_mask(trees: list[DraftTree] | None, lengths: list[int], width: int, span: int,
                            dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [B, 1, W, span + W]
    """The mask of a forward whose keys are each row's first `span` cache slots followed by its W new entries (not
    yet written): row b's query i sees slots [0, lengths[b]) and its tree's ancestors of node i among the new
    entries (`trees` None: inputs 0..i, a chain). Padding queries see only their own new entry."""
    new, real = _new_entries_visible(trees, width, rows=len(lengths))
    visible = torch.zeros(len(lengths), width, span + width, dtype=torch.bool)
    visible[..., :span] = (torch.arange(span) < torch.tensor(lengths)[:, None, None]) & real[..., None]
    visible[..., span:] = new
    return additive_mask(visible, dtype, device)


def _new_entries_visible(trees: list[DraftTree] | None, width: int,
                         rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a forward's W new entries each query sees, [B, W, W] bool: node i its tree's ancestors (itself
    included), a padding query (i >= its tree's size) only its own entry; `trees` None: a chain over `rows` rows,
    inputs 0..i. And which queries are real, [B, W] bool (padding ones see no prefix)."""
    if trees is None:
        return (torch.ones(width, width, dtype=torch.bool).tril().expand(rows, width, width),
                torch.ones(rows, width, dtype=torch.bool))
    new = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    real = torch.zeros(len(trees), width, dtype=torch.bool)
    for b, tree in enumerate(trees):
        n = tree.input_size  # the nodes, then any extra rows
        new[b, :n, :n] = tree.input_visible
        real[b, :n] = True
    return new, real

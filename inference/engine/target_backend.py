"""The seam between the engine loop and whatever runs the target: prefill a row, verify every running row's tree in
one forward, commit each row's accepted path, and hand over the hidden states heads read.

The engine drives one `TargetBackend`; the proposers, trees, node budget, verifier and sampling never see which.
`TorchBackend` is our PyTorch forward (HF's or the lean one) over a `BatchKVCache`; `llamacpp_backend.py` runs
llama.cpp's kernels through libllama. A third (a GPU runtime) implements the same five calls.

Rows: a backend holds up to `max_rows` sequences in rows 0..n-1, kept contiguous (a freed row is refilled by the
last one). A row's committed length excludes its pending root: after `prefill` the prompt's last token, after each
`verify` the tree just run; `commit(row, path)` keeps the path's nodes (the root first) and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.batch_cache import BatchKVCache
from specheads.inference.engine.forward import (
    batch_forward,
    check_tree_attention,
    model_device,
    model_max_context,
    prefill_forward,
)
from specheads.inference.engine.layer_attention import layer_attention
from specheads.inference.engine.lean_forward import target_forward
from specheads.inference.engine.tree import DraftTree

# HF `hidden_states` order (embeddings first, the final norm's output last), one [B, N, H] tensor per entry; a
# backend that reads only some layers leaves the others None (`Proposer.target_layers` names those a proposer reads)
TargetHidden = tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [B, W, V]: verify, row b's input i (nodes, then extra rows, then padding); prefill [1, 1, V]
    hidden_states: TargetHidden | None  # each [B, W, H] (prefill: [1, P, H] over the whole prompt), or None


class TargetBackend(Protocol):
    """What runs the target's forwards and holds its KV cache (see the module doc)."""

    name: str
    device: torch.device  # where logits and hidden states land
    max_leaves: int | None  # the most leaves a row's tree may have (the engine prunes to fit); None: any
    max_context: int | None  # the longest sequence a row can hold (None: no stated limit)

    def read_layers(self, layers: tuple[int, ...] | None) -> None:
        """Keep the target's hidden_states at these indices (-1: the last; None: every layer) from the forwards that
        ask for hidden states; the others may stay None."""

    def add_row(self, capacity: int) -> int:
        """Occupy the next free row for a sequence of at most `capacity` tokens; returns its index."""

    def prefill(self, row: int, prompt: torch.Tensor, *, hidden: bool) -> TargetOutput:
        """Run the prompt [P] into the empty `row`: logits for its last position; its last token stays pending (the
        first step's root)."""

    def verify(self, first_row: int, trees: list[DraftTree], *, hidden: bool) -> TargetOutput:
        """One forward over rows first_row .. first_row + len(trees) - 1, row b's input `trees[b]` on top of its
        committed prefix (positions = length + depth)."""

    def commit(self, row: int, path: torch.Tensor) -> None:
        """Keep `row`'s last forward's nodes `path` ([K] long, the root first, each the parent of the next) right after
        its prefix; drop the rest."""

    def remove_row(self, row: int) -> int | None:
        """Free `row`; the last row moves into it. Returns the moved row's old index, or None when `row` was last."""

    def committed_tokens(self) -> int:
        """Committed cache entries over every occupied row."""

    def reset(self) -> None:
        """Drop every row (after a failed step, whose rows may be half-written)."""

    # A backend other than our PyTorch one also has, for its verify-cost curve (`verify_cost.py`): `vocab_size`,
    # `cost_key()` (what its step time depends on) and `measurement_copy(rows, capacity)` (a fresh one to time).


class TorchBackend:
    """Our PyTorch forward of an HF causal LM: "lean" (`lean_forward.py`: fused projections, fewer calls;
    Llama-family targets), "hf" (the model's own forward) or "auto" (lean where the family allows it); `compile`
    compiles the lean forward's elementwise work. Trees are verified under a 4-D mask over a `BatchKVCache`."""

    name = "torch"
    max_leaves = None

    def __init__(self, model: PreTrainedModel, *, max_rows: int = 1, step: str = "auto",
                 compile: bool = False) -> None:
        self.lean = target_forward(model, step, compile)
        self.attention = layer_attention(model.config)  # read once: every forward's masks follow it
        self.model = model.eval()
        self.device = model_device(model)
        self.max_context = model_max_context(model)
        self.max_rows = max_rows
        self._cache: BatchKVCache | None = None
        check_tree_attention(model)

    def read_layers(self, layers: tuple[int, ...] | None) -> None:
        """HF's forward gives every layer's hidden state at once: nothing to choose."""

    def add_row(self, capacity: int) -> int:
        if self._cache is None:
            self._cache = BatchKVCache(self.model.config, rows=self.max_rows, capacity=capacity + 16)
        return self._cache.add_row()

    def prefill(self, row: int, prompt: torch.Tensor, *, hidden: bool) -> TargetOutput:
        out = prefill_forward(self.model, self._cache, row, prompt, output_hidden_states=hidden, lean=self.lean,
                              attention=self.attention)
        self._cache.lengths[row] = prompt.shape[0] - 1  # the root's entry is committed with the step's path
        return TargetOutput(out.logits[:, -1:], out.hidden_states if hidden else None)

    def verify(self, first_row: int, trees: list[DraftTree], *, hidden: bool) -> TargetOutput:
        out = batch_forward(self.model, self._cache, trees, first_row, output_hidden_states=hidden, lean=self.lean,
                            attention=self.attention)
        return TargetOutput(out.logits, out.hidden_states if hidden else None)

    def commit(self, row: int, path: torch.Tensor) -> None:
        self._cache.commit(row, path)

    def remove_row(self, row: int) -> int | None:
        return self._cache.remove_row(row)

    def committed_tokens(self) -> int:
        return sum(self._cache.lengths) if self._cache is not None else 0

    def reset(self) -> None:
        self._cache = None

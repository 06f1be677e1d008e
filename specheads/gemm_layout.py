"""Memory layout of linear-layer weights, chosen for the few-row GEMMs of speculative decoding.

A verify forward multiplies a handful of rows (the tree's nodes) by every weight matrix. On CPU in
fp32, PyTorch's GEMM for `x @ W.T` with W stored row-major ([out, in], the nn.Linear default) is
slow for 4-48 rows: it repacks W on every call. With W stored column-major (the same [out, in] tensor
whose transpose is contiguous), the same product runs 2-5x faster for those sizes and about as fast
for one row (measured with `scripts/bench_forward.py`). Values, shapes, parameter names and weight
ties are unchanged; only strides differ, so checkpoints are unaffected and products differ only in
GEMM rounding (~1e-5 relative). Speculative greedy output still equals `ar`'s in the same layout.

Layouts: "row" (as loaded), "column", or "auto": column for fp32 on CPU, row elsewhere (cuBLAS and
the oneDNN bf16 paths are fastest with the row-major weights they were tuned for).
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUTS = ("auto", "row", "column")


def resolve_layout(layout: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"row" or "column" for a model on `device` in `dtype`; a bad name lists the known ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; use one of: {', '.join(LAYOUTS)}")
    if layout != "auto":
        return layout
    return "column" if torch.device(device).type == "cpu" and dtype == torch.float32 else "row"


def set_linear_layout(module: nn.Module, layout: str) -> nn.Module:
    """Store every nn.Linear weight in `module` row- or column-major, in place (tied weights stay tied)."""
    if layout not in ("row", "column"):
        raise ValueError(f"layout must be 'row' or 'column', got {layout!r}")
    seen: set[int] = set()
    for sub in module.modules():
        if not isinstance(sub, nn.Linear) or id(sub.weight) in seen:
            continue
        seen.add(id(sub.weight))
        with torch.no_grad():
            w = sub.weight.data
            sub.weight.data = w.contiguous() if layout == "row" else w.t().contiguous().t()
    return module


def linear_layout(module: nn.Module) -> str:
    """The layout of `module`'s first nn.Linear weight ("row" when it has none)."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            w = sub.weight
            return "column" if not w.is_contiguous() and w.t().is_contiguous() else "row"
    return "row"

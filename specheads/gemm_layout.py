"""Memory layout of linear-layer weights, chosen for the few-row GEMMs of speculative decoding.

A verify forward multiplies a handful of rows (the tree's nodes) by every weight matrix. On CPU in
fp32, PyTorch's GEMM for `x @ W.T` with W stored row-major ([out, in], the nn.Linear default) is
slow for 4-48 rows: it repacks W on every call. With W stored column-major (the same [out, in] tensor
whose transpose is contiguous), the same product runs several times faster for those sizes and about as
fast for one row (`scripts/lab/bench_forward.py` measures it; figures in docs/results.md). Values, shapes,
parameter names and weight ties are unchanged; only strides differ, so checkpoints are unaffected and
products differ only in GEMM rounding (~1e-5 relative). Speculative greedy output still equals `ar`'s in
the same layout.

In bf16 on a CPU with native bf16 (AMX or AVX512-BF16), oneDNN's GEMM likewise reorders a row-major W
into its blocked layout on every call, which costs more than the product itself for a few rows. The
"packed" layout reorders each bf16 weight once, at load, and runs the layer's products on that copy
(`PackedLinear`): a 16-node verify of the default target then costs far less over a one-token step
than in fp32 (docs/results.md, "bf16 with packed weights"). The products are oneDNN's own bf16 kernels, as in the row
layout; the parameters stay as they were (names, values, ties, checkpoints), and the packed copies
are one more copy of the linear weights in memory.

Some CPUs' BLAS runs neither form fast for a few rows: there the "transposed" layout keeps W row-major and
writes each product as (W xᵀ)ᵀ, a GEMM whose small dimension is the output's columns (`TransposedLinear`;
`scripts/lab/bench_gemm.py` compares the forms on a machine, docs/results.md has the figures). It is opt-in.

Layouts: "row" (as loaded), "column", "packed", "transposed", or "auto": column for fp32 on CPU, packed for bf16
on a CPU with native bf16, row elsewhere (cuBLAS is fastest with the row-major weights it was tuned for).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("auto", "row", "column", "packed", "transposed")
PACK_ROWS = 16  # the row count oneDNN tunes the packing for (a tree verify's); one row runs as fast on it (measured)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower
    than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


@functools.cache
def packing_available() -> bool:
    """Whether oneDNN packs and multiplies bf16 linear weights here (a CPU build with mkldnn, on a CPU it supports)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16),
                                               torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
                                               None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool((y == 16).all())


def resolve_layout(layout: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"row", "column", "packed" or "transposed" for a model on `device` in `dtype`; a bad name lists the known
    ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; use one of: {', '.join(LAYOUTS)}")
    on_cpu = torch.device(device).type == "cpu"
    if layout == "packed" and not (on_cpu and dtype == torch.bfloat16 and packing_available()):
        raise ValueError(f"--weight-layout packed is for bf16 on CPU (oneDNN); this model is {dtype} on "
                         f"{torch.device(device).type}{'' if packing_available() else ' without oneDNN'}: use "
                         f"--dtype bfloat16 on CPU, or --weight-layout auto")
    if layout != "auto":
        return layout
    if on_cpu and dtype == torch.float32:
        return "column"
    if on_cpu and dtype == torch.bfloat16 and cpu_has_native_bf16() and packing_available():
        return "packed"
    return "row"


class PackedLinear(nn.Linear):
    """An nn.Linear whose bf16 products run on a oneDNN-packed copy of its weight (`packed_weight`, made once).

    Set by `set_linear_layout(module, "packed")` on existing layers (their class is switched in place, so
    parameters, names and ties stay). Anything else than a bf16 CPU input without gradients (fp32 after
    `.float()`, another device, training) takes plain `F.linear` on `weight`.
    """

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_weight", None)
        if (packed is None or x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16
                or x.device.type != "cpu" or x.numel() == 0 or (torch.is_grad_enabled() and x.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    # .to(), .float(), ...: the packed copy goes where the weight leaves bf16 CPU
    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        if self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            self.__dict__.pop("packed_weight", None)
        return module

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        # oneDNN's packed tensor has no storage to copy: copy the plain layer and pack the copy's own weight
        packed = self.__dict__.pop("packed_weight", None)
        self.__class__ = nn.Linear
        try:
            clone = copy.deepcopy(self, memo)
        finally:
            self.__class__ = PackedLinear
            if packed is not None:
                self.packed_weight = packed
        return _pack(clone, {})


class TransposedLinear(nn.Linear):
    """An nn.Linear whose product is written (W xᵀ)ᵀ on its row-major weight: for a few rows this is a GEMM whose
    small dimension is the output's columns, which some CPUs' BLAS runs several times faster than x Wᵀ. One row
    takes `F.linear` (a matrix-vector product either way).

    Set by `set_linear_layout(module, "transposed")` on existing layers (their class is switched in place, so
    parameters, names and ties stay). The value is the same product up to GEMM rounding, in every dtype and on
    every device; the output is contiguous, as `F.linear`'s.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= x.shape[-1]:  # one row (or none): x Wᵀ is a matrix-vector product, as fast as it gets
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        out = (self.weight @ rows.T).T.contiguous()  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])


def _pack(layer: nn.Linear, packed: dict[int, torch.Tensor]) -> nn.Linear:
    """`layer` as a PackedLinear when its weight is bf16 on CPU (`packed`: copies already made, by weight id)."""
    if layer.weight.dtype != torch.bfloat16 or layer.weight.device.type != "cpu":
        return layer
    key = id(layer.weight)
    if key not in packed:
        packed[key] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_ROWS)
    layer.__class__ = PackedLinear
    layer.packed_weight = packed[key]
    return layer


def set_linear_layout(module: nn.Module, layout: str) -> nn.Module:
    """Store every nn.Linear weight in `module` row- or column-major, pack its bf16 weights ("packed": other
    dtypes stay row-major), or keep them row-major with products written (W xᵀ)ᵀ ("transposed"), in place; tied
    weights stay tied."""
    if layout not in ("row", "column", "packed", "transposed"):
        raise ValueError(f"layout must be 'row', 'column', 'packed' or 'transposed', got {layout!r}")
    packed: dict[int, torch.Tensor] = {}  # id(weight) -> its packed copy, shared by layers that share it
    for sub in module.modules():
        if not isinstance(sub, nn.Linear) or (layout == "packed" and "packed_weight" in sub.__dict__):
            continue  # already packed, e.g. a target's LM head that heads share
        if isinstance(sub, (PackedLinear, TransposedLinear)):  # back to a plain layer first
            sub.__class__ = nn.Linear
            sub.__dict__.pop("packed_weight", None)
        with torch.no_grad():
            w = sub.weight.data
            sub.weight.data = w.t().contiguous().t() if layout == "column" else w.contiguous()
        if layout == "packed":
            _pack(sub, packed)
        elif layout == "transposed":
            sub.__class__ = TransposedLinear
    return module


@contextlib.contextmanager
def plain_linears(module: nn.Module) -> Iterator[nn.Module]:
    """Within: every `PackedLinear` and `TransposedLinear` of `module` runs as a plain nn.Linear on its own weight, for
    code that traces the model (torch.compile cannot take oneDNN's packed tensors); after: as before."""
    switched = [(sub, type(sub)) for sub in module.modules() if type(sub) in (PackedLinear, TransposedLinear)]
    for sub, _ in switched:
        sub.__class__ = nn.Linear
    try:
        yield module
    finally:
        for sub, cls in switched:
            sub.__class__ = cls


def linear_layout(module: nn.Module) -> str:
    """The layout of `module`'s first nn.Linear weight ("row" when it has none)."""
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            return "packed"
        if isinstance(sub, TransposedLinear):
            return "transposed"
        if isinstance(sub, nn.Linear):
            w = sub.weight
            return "column" if not w.is_contiguous() and w.t().is_contiguous() else "row"
    return "row"

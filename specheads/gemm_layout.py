"""Memory layout of linear-layer weights, and the kernel their products run on, for the few-row GEMMs of speculative
decoding.

A verify forward multiplies a handful of rows (the tree's nodes) by every weight matrix. On CPU in
fp32, PyTorch's GEMM for `x @ W.T` with W stored row-major ([out, in], the nn.Linear default) is
slow for 4-48 rows: it repacks W on every call. With W stored column-major (the same [out, in] tensor
whose transpose is contiguous), the same product runs several times faster for those sizes on some CPUs and about as
fast for one row (`scripts/lab/bench_gemm.py` measures it; figures in docs/results.md). Values, shapes,
parameter names and weight ties are unchanged; only strides differ, so checkpoints are unaffected and
products differ only in GEMM rounding (~1e-5 relative). Speculative greedy output still equals `ar`'s in
the same layout.

Other forms are kernels a layer runs on its row-major weight (`PlannedLinear`, with one kernel per row count; see
`gemm_choice.py`): oneDNN's linear on a copy of the weight reordered once into its blocked layout ("packed": oneDNN
otherwise reorders a row-major W on every call, which costs more than the product itself for a few rows), or the
product written (W xᵀ)ᵀ, a GEMM whose small dimension is the output's columns ("transposed": some CPUs' BLAS runs
neither row- nor column-major W fast for a few rows).

Layouts:
- "row" (as loaded), "column";
- "packed": every product on oneDNN's packed copy (fp32 or bf16 on CPU);
- "transposed": (W xᵀ)ᵀ for more than one row;
- "measured": each weight shape's products, at each row count, on the kernel measured fastest on this machine
  (`gemm_choice.plans`; measured once per machine and cached);
- "auto": measured for fp32 on CPU, packed for bf16 on a CPU with native bf16, row elsewhere (cuBLAS is fastest with
  the row-major weights it was tuned for).
The packed copies are one more copy of the weights they pack in memory, made at a layer's first product that runs
on one (under "measured", only where packing wins at a row count the forward uses).

A graph compiled with torch.compile reaches a planned layer's kernels through `traceable_product`: one opaque op per
product (`specheads::planned_linear`), which the compiler leaves alone and which runs the layer's plan when the graph
runs.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specheads import gemm_choice
from specheads.gemm_choice import BUCKETS, Plan, bucket, pack, packing_available, run_kernel
from specheads.machine import cpu_has_native_bf16

LAYOUTS = ("auto", "row", "column", "packed", "transposed", "measured")
_ALL_PACKED: Plan = ("packed",) * len(BUCKETS)
_TRANSPOSED: Plan = ("row",) + ("transposed",) * (len(BUCKETS) - 1)  # one row: a matrix-vector product either way


def resolve_layout(layout: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"row", "column", "packed", "transposed" or "measured" for a model on `device` in `dtype`; a bad name lists the
    known ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; use one of: {', '.join(LAYOUTS)}")
    on_cpu = torch.device(device).type == "cpu"
    if layout in ("packed", "measured") and not on_cpu:
        raise ValueError(f"--weight-layout {layout} chooses CPU kernels; this model is on {torch.device(device).type}: "
                         "use --weight-layout auto")
    if layout == "packed" and not packing_available(dtype):
        raise ValueError(f"--weight-layout packed needs oneDNN packing of {dtype} weights, which this CPU or torch "
                         "build lacks: use --weight-layout auto")
    if layout != "auto":
        return layout
    if on_cpu and dtype == torch.float32:
        return "measured"
    if on_cpu and dtype == torch.bfloat16 and cpu_has_native_bf16() and packing_available(dtype):
        return "packed"
    return "row"


class PlannedLinear(nn.Linear):
    """An nn.Linear whose products run on the kernel its `plan` names for their row count (see `gemm_choice.py`).

    Set by `set_linear_layout` on existing layers (their class is switched in place, so parameters, names and ties
    stay). "packed" entries run on `packed_weight`, a oneDNN copy of the weight made at the first product that needs
    it (so layers a forward never calls, such as the separate q/k/v of a target whose lean forward fuses them, cost
    no memory) and made again if the weight is replaced. An input of another dtype or device than the weight, or a
    product that needs gradients, takes `F.linear` there instead.
    """

    plan: Plan
    layout: str  # the layout that set the plan, for `linear_layout`
    packed_weight: torch.Tensor
    packed_from: int  # data_ptr() of the weight packed_weight was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        kernel = self.plan[bucket(x.numel() // width)] if width and x.numel() else "row"
        packed = self._packed(x) if kernel == "packed" else None
        return run_kernel("row" if kernel == "packed" and packed is None else kernel, x, self.weight, self.bias, packed)

    def _packed(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight for x's product, made now if missing or stale; None where oneDNN's product cannot run."""
        w = self.weight
        if (x.dtype != w.dtype or x.device.type != "cpu" or w.device.type != "cpu" or not packing_available(w.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return None
        if self.__dict__.get("packed_from") != w.data_ptr():
            self.packed_weight, self.packed_from = pack(w), w.data_ptr()
        return self.packed_weight

    # .to(), .float(), ...: no stale copy is kept beside a weight that moved or changed dtype
    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        if self.__dict__.get("packed_from") != self.weight.data_ptr():
            self.__dict__.pop("packed_weight", None)
            self.__dict__.pop("packed_from", None)
        return module

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        # oneDNN's packed tensor has no storage to copy: copy the plain layer, which packs its own weight when used
        packed = {k: self.__dict__.pop(k) for k in ("packed_weight", "packed_from") if k in self.__dict__}
        self.__class__ = nn.Linear
        try:
            clone = copy.deepcopy(self, memo)
        finally:
            self.__class__ = PlannedLinear
            self.__dict__.update(packed)
        clone.__class__ = PlannedLinear
        return clone


def set_linear_layout(module: nn.Module, layout: str) -> nn.Module:
    """Store every nn.Linear weight in `module` row- or column-major, or set the kernels its products run on
    ("packed", "transposed", "measured": see the module doc), in place; tied weights stay tied. Layers of a layout
    already set (e.g. a target's LM head that heads share) keep theirs."""
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS[1:])}, got {layout!r}")
    layers = [sub for sub in module.modules() if isinstance(sub, nn.Linear)
              and not (isinstance(sub, PlannedLinear) and sub.layout == layout)]
    on_cpu = [sub for sub in layers if sub.weight.device.type == "cpu"]
    measured = {} if layout != "measured" else {  # (shape, dtype) -> plan
        (shape, dtype): plan for dtype in {sub.weight.dtype for sub in on_cpu}
        for shape, plan in gemm_choice.plans([tuple(sub.weight.shape) for sub in on_cpu
                                              if sub.weight.dtype == dtype], dtype).items()}
    for sub in layers:
        if isinstance(sub, PlannedLinear):  # back to a plain layer first
            sub.__class__ = nn.Linear
            for key in ("plan", "layout", "packed_weight", "packed_from"):
                sub.__dict__.pop(key, None)
        with torch.no_grad():
            w = sub.weight.data
            sub.weight.data = w.t().contiguous().t() if layout == "column" else w.contiguous()
        plan = {"packed": _ALL_PACKED, "transposed": _TRANSPOSED}.get(layout)
        if layout == "measured" and sub.weight.device.type == "cpu":
            plan = measured[tuple(sub.weight.shape), sub.weight.dtype]
        if plan is not None:
            sub.__class__ = PlannedLinear
            sub.plan, sub.layout = plan, layout
    return module


_traced: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # slot -> the PlannedLinear a graph calls
_slots = itertools.count()


# an op defined on the dispatcher directly: torch.library.custom_op's Python wrapper costs about as much again per call,
# and a step calls this op for every product
_library = torch.library.Library("specheads", "DEF")
_library.define("planned_linear(Tensor x, Tensor weight, Tensor? bias, int slot) -> Tensor")


def _planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    """x times weightᵀ (+ bias) on the kernels of the PlannedLinear registered at `slot`, whose weight `weight` is;
    a weight that is not that layer's own (a copy a compiler made, say) runs `F.linear`."""
    layer = _traced.get(slot)
    if layer is None or layer.weight.data_ptr() != weight.data_ptr() or layer.weight.shape != weight.shape:
        return F.linear(x, weight, bias)
    return layer.forward(x)


_library.impl("planned_linear", _planned_linear, "CPU")


@torch.library.register_fake("specheads::planned_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def traceable_product(layer: nn.Linear) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """(x, weight, bias) -> x weightᵀ + bias, in a form torch.compile traces, for a graph that holds `layer`'s weight
    and bias itself: a `PlannedLinear`'s product is one opaque op (`specheads::planned_linear`) that runs the layer's
    plan when the graph runs, so the graph's products stay on the kernels measured fastest here (inductor would
    otherwise put them on its own); any other layer's is `F.linear`, which the compiler lowers as it likes."""
    if not isinstance(layer, PlannedLinear) or layer.weight.device.type != "cpu":
        return F.linear
    slot = layer.__dict__.get("traced_slot")
    if slot is None or _traced.get(slot) is not layer:
        slot = layer.traced_slot = next(_slots)
        _traced[slot] = layer
    return lambda x, weight, bias: torch.ops.specheads.planned_linear(x, weight, bias, slot)


@contextlib.contextmanager
def plain_linears(module: nn.Module) -> Iterator[nn.Module]:
    """Within: every `PlannedLinear` of `module` runs as a plain nn.Linear on its own weight, for code that traces the
    model (torch.compile cannot take oneDNN's packed tensors); after: as before."""
    switched = [sub for sub in module.modules() if type(sub) is PlannedLinear]
    for sub in switched:
        sub.__class__ = nn.Linear
    try:
        yield module
    finally:
        for sub in switched:
            sub.__class__ = PlannedLinear


def layout_plans(module: nn.Module) -> dict[tuple[int, int], Plan]:
    """The plan of each weight shape among `module`'s planned layers (empty for row and column layouts)."""
    return {tuple(sub.weight.shape): sub.plan for sub in module.modules() if isinstance(sub, PlannedLinear)}


def linear_layout(module: nn.Module) -> str:
    """The layout of `module`'s first nn.Linear weight ("row" when it has none)."""
    for sub in module.modules():
        if isinstance(sub, PlannedLinear):
            return sub.layout
        if isinstance(sub, nn.Linear):
            w = sub.weight
            return "column" if not w.is_contiguous() and w.t().is_contiguous() else "row"
    return "row"

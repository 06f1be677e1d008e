"""Which kernel each linear layer's product runs on, by weight shape and row count, measured on this machine.

A verify forward multiplies a few rows (the tree's nodes, times the batch's rows) by every weight matrix, and which
way of writing that product is fastest depends on the CPU, its BLAS, the shape and the row count. On a 2-core AVX2
EPYC, for example (docs/results.md, "kernels chosen by measurement"): one row runs fastest on oneDNN's packed weights,
four rows on (W xᵀ)ᵀ over the row-major weight, at about 2.5x the read rate of `F.linear` there. So nothing is
assumed: for every distinct (out, in) shape, each kernel is timed at every row bucket on cold copies of a weight of
that shape, and the fastest is kept. The plans are cached per machine (CPU, its flags, threads, torch, dtype) under
`specheads_home()/gemm-choice/`, measured again after `MAX_AGE_S`, and kept in memory for the life of the process, so
every layer of a shape runs the same plan in every forward.

Kernels (all give the same product up to GEMM rounding; `gemm_layout.PlannedLinear` runs them):
- "row": `F.linear(x, W)` on the row-major weight;
- "transposed": (W xᵀ)ᵀ on the row-major weight, a GEMM whose small dimension is the output's columns;
- "packed": oneDNN's linear on a copy of W reordered once into its blocked layout (x86 CPU builds with oneDNN).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from specheads.cached import specheads_home
from specheads.machine import cpu_flags, cpu_name

log = logging.getLogger(__name__)

KERNELS = ("row", "transposed", "packed")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a product of M rows runs the plan of the smallest bucket >= M (the last above)
PACK_ROWS = 16  # the row count oneDNN tunes its packing for (a tree verify's); one row runs as fast on it (measured)
COLD_BYTES = 48 * 2**20  # copies cycled through when timing a shape: past the last-level caches of common CPUs
MAX_COPIES = 64
REPS = 3  # interleaved timing rounds; the fastest of each is kept (noise only ever adds time)
MAX_AGE_S = 30 * 24 * 3600.0

Plan = tuple[str, ...]  # one kernel per bucket of BUCKETS
Shape = tuple[int, int]  # (out_features, in_features)


def bucket(rows: int) -> int:
    """The index in BUCKETS whose plan entry a product of `rows` rows runs."""
    return min(bisect.bisect_left(BUCKETS, rows), len(BUCKETS) - 1)


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN packs and multiplies linear weights of `dtype` here (a CPU build with mkldnn, on a CPU it
    supports)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype),
                                               torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
                                               None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool((y == 16).all())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once for oneDNN's linear (an opaque tensor: no storage to copy or save)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def run_kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times `weight`ᵀ (+ bias) by `kernel` -> [..., out], contiguous as `F.linear`'s."""
    if kernel == "packed" and packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if kernel == "transposed" and x.numel() > x.shape[-1]:  # one row: a matrix-vector product either way
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        out = (weight @ rows.T).T.contiguous()  # [M, out]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def measure_plan(shape: Shape, dtype: torch.dtype, reps: int = REPS) -> tuple[Plan, dict[str, list[float | None]]]:
    """The fastest kernel at each bucket for weights of `shape` and `dtype` on this CPU, and every kernel's seconds
    per product at each bucket (the fastest of `reps` interleaved rounds over cold copies; None: not a candidate
    there)."""
    out_features, in_features = shape
    kernels = [k for k in KERNELS if k != "packed" or packing_available(dtype)]
    gen = torch.Generator().manual_seed(0)
    copies = max(2, min(MAX_COPIES, -(-COLD_BYTES // (out_features * in_features * dtype.itemsize))))
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(copies)]
    packed = [pack(w) for w in weights] if "packed" in kernels else [None] * copies
    best: dict[str, list[float | None]] = {k: [None] * len(BUCKETS) for k in kernels}
    with torch.inference_mode():
        for rep in range(reps + 1):  # round 0 warms up each kernel's code paths and buffers
            for b, rows in enumerate(BUCKETS):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                for k in kernels:
                    if k == "transposed" and rows == 1:
                        continue  # one row runs F.linear either way
                    start = time.perf_counter()
                    for w, p in zip(weights, packed):
                        run_kernel(k, x, w, None, p)
                    seconds = (time.perf_counter() - start) / copies
                    if rep and (best[k][b] is None or seconds < best[k][b]):
                        best[k][b] = seconds
    plan = tuple(min((k for k in kernels if best[k][b] is not None), key=lambda k: best[k][b])  # ties: "row"
                 for b in range(len(BUCKETS)))
    return plan, best


def default_cache_dir() -> Path:
    return specheads_home() / "gemm-choice"


def machine_key(dtype: torch.dtype) -> str:
    """What the plans depend on: the CPU and its flags, the threads, torch's version and the dtype."""
    text = "\n".join([cpu_name(), " ".join(cpu_flags()), str(torch.get_num_threads()), torch.__version__, str(dtype)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_plans: dict[tuple[str, Shape], Plan] = {}  # this process's plans: one shape keeps one plan for the process's life


def plans(shapes: Iterable[Shape], dtype: torch.dtype, cache_dir: Path | None = None,
          measure: Callable[[Shape, torch.dtype], tuple[Plan, dict]] = measure_plan) -> dict[Shape, Plan]:
    """A plan for every shape: this process's, the machine's cache's, or measured now (a second or so a shape for a
    small target's, once per machine) and cached."""
    key = machine_key(dtype)
    wanted = sorted(set(shapes))
    missing = [s for s in wanted if (key, s) not in _plans]
    if missing:
        path = (cache_dir or default_cache_dir()) / f"{key}.json"
        entries = _read(path)
        fresh = {s: e["plan"] for s in missing if (e := entries.get(_name(s))) is not None
                 and time.time() - e.get("measured_at", 0) <= MAX_AGE_S and _valid(e.get("plan"), dtype)}
        to_measure = [s for s in missing if s not in fresh]
        if to_measure:
            log.info("measuring the fastest product kernel for %d weight shape(s) in %s on this machine (once; "
                     "cached in %s)", len(to_measure), dtype, path.parent)
            for s in to_measure:
                plan, seconds = measure(s, dtype)
                fresh[s] = plan
                entries[_name(s)] = {"plan": list(plan), "seconds": seconds, "measured_at": time.time()}
            _write(path, entries)
        for s in missing:
            _plans[key, s] = tuple(fresh[s])
    return {s: _plans[key, s] for s in wanted}


def known(dtype: torch.dtype) -> dict[Shape, Plan]:
    """Every plan this process runs for `dtype` on this machine (the shapes its layers have asked for)."""
    key = machine_key(dtype)
    return {shape: plan for (k, shape), plan in _plans.items() if k == key}


def describe(plan_of: dict[Shape, Plan]) -> str:
    """The plans in words, one shape per line: "576x1536: 1 packed, 2-4 transposed, 8-64 packed"."""
    lines = []
    for (out_features, in_features), plan in sorted(plan_of.items()):
        runs, start = [], 0
        for b in range(1, len(plan) + 1):
            if b == len(plan) or plan[b] != plan[start]:
                low, high = BUCKETS[start - 1] + 1 if start else 1, BUCKETS[b - 1]
                label = f"{low}" if low == high else f"{low}-{high}" if b < len(plan) else f"{low}+"
                runs.append(f"{label} {plan[start]}")
                start = b
        lines.append(f"{out_features}x{in_features}: rows " + ", ".join(runs))
    return "\n".join(lines)


def _name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _valid(plan: object, dtype: torch.dtype) -> bool:
    return (isinstance(plan, list) and len(plan) == len(BUCKETS) and all(k in KERNELS for k in plan)
            and ("packed" not in plan or packing_available(dtype)))


def _read(path: Path) -> dict[str, dict]:
    """The cached entries by shape name; a missing or damaged file reads as none (measured again, overwritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def _write(path: Path, entries: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{time.monotonic_ns()}")
    tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    tmp.replace(path)

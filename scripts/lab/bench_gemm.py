"""Few-row products of the default target's weight shapes (as the lean forward fuses them), by how the product is
written, with cold weights.

    .venv/bin/python scripts/lab/bench_gemm.py [--target default] [--rows 1,4,16] [--reps 5]

A verify forward multiplies a few rows (the tree's nodes) by every weight matrix, each read once from memory. For
each matrix shape of the target (attention, MLP, LM head) this cycles through enough distinct fp32 copies that
none stays in the last-level cache, as a model's layers do, and times `y = x Wᵀ` written four ways:

- `linear`: `F.linear(x, W)` with W row-major (`--weight-layout row`);
- `x@Wt`: `x @ Wᵀ` with Wᵀ contiguous (what `--weight-layout column` makes `F.linear` do);
- `W@xT`: `(W @ xᵀ)ᵀ` with W row-major (a GEMM whose small dimension is the output's columns);
- `mkldnn`: oneDNN's linear on the row-major W;
- `packed`: oneDNN's linear on W reordered once into its blocked layout (`--weight-layout packed`).

It prints the weights' effective read rate (bytes of W per second; higher is better): what a step's products can
approach is the machine's read bandwidth (`scripts/lab/profile_step.py` probes it). The four give the same product up
to GEMM rounding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from specheads.target import resolve_target

COLD_BYTES = 256 * 2**20  # cycle through at least this many bytes of copies: far past any last-level cache


def shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each distinct weight matrix the engine's lean forward multiplies (q/k/v and gate/up fused), and
    the LM head."""
    c = config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return {"qkv": (c.num_attention_heads * head_dim + 2 * kv, c.hidden_size), "o": (c.hidden_size, c.hidden_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def products(ws: list[torch.Tensor], wts: list[torch.Tensor], packed: list[torch.Tensor],
             x: torch.Tensor) -> dict[str, Callable[[], object]]:
    ways = {"linear": lambda: [F.linear(x, w) for w in ws], "x@Wt": lambda: [x @ wt for wt in wts],
            "W@xT": lambda: [(w @ x.T).T for w in ws]}
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        ways["mkldnn"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in ws]
        ways["packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed]
    return ways


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--rows", default="1,4,16", help="comma list of row counts (tree nodes)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"fp32, {torch.get_num_threads()} threads; GB/s of weights read per product (higher is better)")
    for name, (n, k) in shapes(AutoConfig.from_pretrained(resolve_target(args.target))).items():
        copies = max(2, -(-COLD_BYTES // (n * k * 4)))
        ws = [torch.randn(n, k, generator=gen) for _ in range(copies)]
        wts = [w.T.contiguous() for w in ws]
        packed = ([torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
                  if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") else [])
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            rates = {way: n * k * 4 * copies / median_seconds(fn, args.reps) / 1e9
                     for way, fn in products(ws, wts, packed, x).items()}
            print(f"{name:>8} x{copies:<4} rows {m:>3}: " + "  ".join(f"{way} {r:5.1f}" for way, r in rates.items()))
        del ws, wts, packed


if __name__ == "__main__":
    main()

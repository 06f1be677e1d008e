"""What a small elementwise operator costs alone, and what it adds right after a weight product.

    .venv/bin/python scripts/lab/bench_op_after_product.py [--shape 1536x576] [--hidden 576] [--reps 3000]

A one-token step of a small target runs some 40 operators per decoder layer between and beside its four products,
each on one row of a few hundred values. Alone, such an operator costs a few microseconds; right after a product
that read megabytes of weights (whose reads evicted the operator's code and data from the core's caches) it costs
more. This times each operator alone, and a product followed by the operator less the product alone, on one row of
`--hidden` values and a weight of `--shape`, in microseconds: blocks of `--calls` calls, the three kinds of block
taking turns `--blocks` times, medians of the blocks' means (the product alone varies by more than a small
operator costs, so only blocks run side by side are compared). Figures: docs/results.md, "the compiled stack on the
measured kernels".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def mean_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1536x576", help="the product's weight, OUTxIN")
    p.add_argument("--hidden", type=int, default=576, help="values in the row the operators run on")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--blocks", type=int, default=25)
    args = p.parse_args()
    out_features, in_features = (int(v) for v in args.shape.split("x"))
    weight, x = torch.randn(out_features, in_features), torch.randn(1, 1, in_features)
    row, norm = torch.randn(1, 1, args.hidden), torch.randn(args.hidden)
    ops: dict[str, Callable[[], object]] = {
        "add": lambda: row + row,
        "mul": lambda: row * norm,
        "pow": lambda: row.pow(2),
        "mean": lambda: row.mean(-1, keepdim=True),
        "silu": lambda: F.silu(row),
        "roll": lambda: row.roll(8, dims=-1),
        "rms_norm": lambda: F.rms_norm(row, (args.hidden,), norm, 1e-5),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; product {args.shape} on one row")
    with torch.inference_mode():
        def product() -> torch.Tensor:
            return F.linear(x, weight)

        mean_us(product, args.calls)  # warm-up
        for name, op in ops.items():
            alone, extra, base = [], [], []
            for _ in range(args.blocks):
                alone.append(mean_us(op, args.calls))
                base.append(mean_us(product, args.calls))
                extra.append(mean_us(lambda op=op: (product(), op()), args.calls) - base[-1])
            print(f"  {name:9s} alone {statistics.median(alone):6.1f} us   after the product "
                  f"+{statistics.median(extra):6.1f} us   (the product alone {statistics.median(base):.1f} us)")

if __name__ == "__main__":
    main()

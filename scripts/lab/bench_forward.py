"""Cost of one target verify forward by tree size, over a 128-token cache, for each weight layout.

    .venv/bin/python scripts/lab/bench_forward.py [--target default] [--device cpu] [--dtype float32]
        [--layouts column,measured] [--nodes 1,2,4,8,16,32,64] [--reps 7]
    (bf16 on a CPU with native bf16: --dtype bfloat16 --layouts row,packed)

Prints the median time per forward of a star-shaped tree (a root and N-1 children; the cost depends on
the node count, not the shape) and its ratio to a one-token step: what a proposer must win back per
step. Each round times every size once with the engine's own forward, as the node budget measures its curve
(`verify_cost.measure_verify_cost`); layouts (`specheads/gemm_layout.py`) take turns round by round, one model
each, so drift hits all alike.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specheads.inference.proposers.verify_cost import measure_verify_cost
from specheads.target import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layouts", default="column,measured", help="comma list of weight layouts to compare")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64", help="comma list of tree sizes (1 = a plain step)")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    layouts = args.layouts.split(",")
    sizes = sorted({1, *(int(n) for n in args.nodes.split(","))})
    models = {name: load_target(args.target, device=args.device, dtype=args.dtype, weight_layout=name)[0]
              for name in layouts}
    first = next(iter(models.values()))
    print(f"{first.dtype}, {torch.get_num_threads()} threads; ms per forward (ratio to one node)")
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in layouts}
    for _ in range(args.reps):
        for name, model in models.items():
            cost = measure_verify_cost(model, sizes=sizes, reps=1)
            for n, seconds in zip(cost.nodes, cost.seconds):
                times[name][n].append(seconds)
    print(f"{'nodes':>5} " + " ".join(f"{name:>16}" for name in layouts))
    for n in sizes:
        ms = {name: 1000 * statistics.median(times[name][n]) for name in layouts}
        one = {name: 1000 * statistics.median(times[name][1]) for name in layouts}
        print(f"{n:>5} " + " ".join(f"{ms[name]:>7.1f} ({ms[name] / one[name]:.2f}x)" for name in layouts))

if __name__ == "__main__":
    main()

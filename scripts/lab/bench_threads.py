"""The engine's step under a competing process, by intra-op thread count.

    .venv/bin/python scripts/lab/bench_threads.py [--target default] [--threads 1,2] [--nodes 1,4] [--reps 5]

A server or a bench often shares its cores with something else. OpenMP threads that spin while the OS has
descheduled one of them can make a product of a few rows collapse on a small CPU. This times a one-token step and a
tree verify (the engine's own forward, as the node budget measures it) with each thread count, first on an idle
machine, then while another process keeps one core busy with its own products (one thread, fp32 matrix products in a
loop). Rounds alternate thread counts so drift hits all alike; medians. Figures: docs/results.md, "threads under a
competing process".
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics

import torch

from specheads.inference.proposers.verify_cost import measure_verify_cost
from specheads.target import load_target


def compete(stop: multiprocessing.Event) -> None:
    """Keep one core busy with fp32 products until `stop` is set."""
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def timings(model, threads: list[int], sizes: list[int], reps: int) -> dict[int, dict[int, float]]:
    """threads -> nodes -> median seconds, rounds alternating thread counts."""
    times = {t: {n: [] for n in sizes} for t in threads}
    for _ in range(reps):
        for t in threads:
            torch.set_num_threads(t)
            cost = measure_verify_cost(model, sizes=sizes, reps=1)
            for n, s in zip(cost.nodes, cost.seconds):
                times[t][n].append(s)
    return {t: {n: statistics.median(v) for n, v in by.items()} for t, by in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--nodes", default="1,4")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    sizes = sorted({1, *(int(n) for n in args.nodes.split(","))})
    model = load_target(args.target, dtype="float32", weight_layout="auto")[0]
    results = {"idle": timings(model, threads, sizes, args.reps)}
    stop = multiprocessing.Event()
    rival = multiprocessing.Process(target=compete, args=(stop,), daemon=True)
    rival.start()
    try:
        results["one core busy"] = timings(model, threads, sizes, args.reps)
    finally:
        stop.set()
        rival.join(timeout=10)
    print("ms per forward by threads and nodes")
    print(f"{'machine':>14} {'threads':>7} " + " ".join(f"{n:>6} nodes" for n in sizes))
    for load, by_threads in results.items():
        for t, by_nodes in by_threads.items():
            print(f"{load:>14} {t:>7} " + " ".join(f"{1000 * by_nodes[n]:>12.1f}" for n in sizes))


if __name__ == "__main__":
    main()

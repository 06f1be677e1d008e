"""Cost of one target verify forward by tree size, over a 256-token cache, for each weight layout.

    .venv/bin/python scripts/lab/bench_forward.py [--target default] [--device cpu] [--dtype float32]
        [--layouts row,column] [--nodes 1,2,4,8,16,32,64] [--reps 7]
    (bf16 on a CPU with native bf16: --dtype bfloat16 --layouts row,packed)

Prints the median time per forward of a star-shaped tree (a root and N-1 children; the cost depends on
the node count, not the shape) and its ratio to a one-token step: what a proposer must win back per
step. Layouts (`specheads/gemm_layout.py`) are timed interleaved, one model each, so drift hits all alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.forward import tree_forward
from specheads.inference.engine.tree import DraftTree
from specheads.target import load_target


def forward_seconds(model, context: torch.Tensor, tree: DraftTree) -> float:
    cache = TreeKVCache(model.config, 512)
    with torch.inference_mode():
        model(input_ids=context, **cache_kwargs(model, cache), logits_to_keep=1)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tree_forward(model, cache, tree)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layouts", default="row,column", help="comma list of weight layouts to compare")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64", help="comma list of tree sizes (1 = a plain step)")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    layouts = args.layouts.split(",")
    sizes = [int(n) for n in args.nodes.split(",")]
    models = {name: load_target(args.target, device=args.device, dtype=args.dtype, weight_layout=name)[0]
              for name in layouts}
    first = next(iter(models.values()))
    vocab = first.config.get_text_config().vocab_size
    torch.manual_seed(0)
    context = torch.randint(100, vocab, (1, 256), device=first.device)
    print(f"{first.dtype}, {torch.get_num_threads()} threads; ms per forward (ratio to one node)")
    print(f"{'nodes':>5} " + " ".join(f"{name:>16}" for name in layouts))
    one: dict[str, float] = {}
    for n in sizes:
        tree = DraftTree(tokens=torch.randint(100, vocab, (n,)), parents=torch.tensor([-1] + [0] * (n - 1)))
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.reps):
            for name, model in models.items():
                times[name].append(forward_seconds(model, context, tree))
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        if n == 1:
            one = ms
        print(f"{n:>5} " + " ".join(f"{ms[name]:>7.1f} ({ms[name] / one.get(name, ms[name]):.2f}x)"
                                    for name in layouts),
              flush=True)


if __name__ == "__main__":
    main()

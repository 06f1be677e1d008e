"""Cost of one target verify forward by tree size, over a 256-token cache (chain and star-shaped trees).

    .venv/bin/python scripts/bench_forward.py [--target default] [--device cpu] [--reps 7]

Prints the median time per forward for 1..32 tree nodes: what a proposer must win back per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specheads.inference.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine import tree_forward
from specheads.inference.tree import DraftTree
from specheads.target import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    model, _ = load_target(args.target, device=args.device)
    vocab = model.config.get_text_config().vocab_size
    context = torch.randint(100, vocab, (1, 256), device=model.device)

    def median_ms(tree: DraftTree) -> float:
        times = []
        for _ in range(args.reps):
            cache = TreeKVCache(model.config, 512)
            with torch.inference_mode():
                model(input_ids=context, **cache_kwargs(model, cache), logits_to_keep=1)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                tree_forward(model, cache, tree)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    print(f"{'nodes':>5} {'chain ms':>9} {'tree ms':>9}")
    for n in (1, 2, 4, 8, 12, 16, 32):
        tokens = torch.randint(100, vocab, (n,))
        chain = median_ms(DraftTree.chain(tokens))
        star = median_ms(DraftTree(tokens=tokens, parents=torch.tensor([-1] + [0] * (n - 1)))) if n > 1 else chain
        print(f"{n:>5} {chain:>9.1f} {star:>9.1f}")


if __name__ == "__main__":
    main()

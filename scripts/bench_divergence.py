"""Cost of the distillation loss, forward and backward, fused (`token_divergence`) against the formulas under
autograd (`token_divergences`, the evaluation path).

    .venv/bin/python scripts/bench_divergence.py [--rows 880] [--vocab 49152] [--reps 5]

Prints the median seconds of loss + backward for each divergence and both ways, timed interleaved so drift hits
both alike, and their ratio. The defaults are one step of the CPU distill recipe: 4 conversations of 320 tokens
hold about 880 assistant positions, over SmolLM2's 49152-token vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specheads.train.divergence import DIVERGENCES, token_divergence, token_divergences


def seconds(fused: bool, name: str, target: torch.Tensor, draft: torch.Tensor) -> float:
    start = time.perf_counter()
    if fused:
        loss = token_divergence(name, target, draft)
    else:
        loss = token_divergences((name,), target, draft)[name]
    loss.mean().backward()
    draft.grad = None
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=880)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(args.rows, args.vocab, generator=generator) * 3
    draft = (torch.randn(args.rows, args.vocab, generator=generator) * 3).requires_grad_(True)
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.reps):
        for name in DIVERGENCES:
            for fused in (True, False):
                times.setdefault((name, fused), []).append(seconds(fused, name, target, draft))
    print(f"loss + backward, [{args.rows}, {args.vocab}] fp32, {torch.get_num_threads()} threads, "
          f"median of {args.reps}")
    print("| divergence | fused s | formulas s | ratio |")
    print("|---|---|---|---|")
    for name in DIVERGENCES:
        fused, formulas = statistics.median(times[name, True]), statistics.median(times[name, False])
        print(f"| {name} | {fused:.2f} | {formulas:.2f} | {formulas / fused:.1f}x |")


if __name__ == "__main__":
    main()

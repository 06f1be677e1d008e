"""One Muon step over the EAGLE-3 drafter's hidden matrices for the default target: torch's Muon (Newton-Schulz in
bf16) against `Fp32Muon` (the same step with the iterations in fp32), and AdamW for scale.

    .venv/bin/python scripts/lab/bench_muon.py [--reps 3]

On a CPU without native bf16 (no AVX512-BF16 or AMX) bf16 products are emulated; this shows what that costs a
training step, and what the fp32 iterations `train/optimizer.py` picks there cost instead. Medians of `--reps` steps
after one warm-up step. Figures: docs/results.md, "products on the kernels measured fastest per machine".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specheads.machine import cpu_has_native_bf16, vector_flags
from specheads.train.optimizer import Fp32Muon

# The hidden matrices of one EAGLE-3 layer over SmolLM2-135M (hidden 576, intermediate 1536, 9 heads of 64, 3 KV
# heads): the fused-features projection, attention over [embedding; hidden] inputs, and the MLP.
SHAPES = [(576, 1728), (576, 1152), (192, 1152), (192, 1152), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def step_seconds(make, reps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for shape in SHAPES]
    optimizer = make(params)
    times = []
    for rep in range(reps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        start = time.perf_counter()
        optimizer.step()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    makers = {
        "torch Muon (bf16 Newton-Schulz)": lambda ps: torch.optim.Muon(ps, lr=0.002, adjust_lr_fn="match_rms_adamw"),
        "Fp32Muon (fp32 Newton-Schulz)": lambda ps: Fp32Muon(ps, lr=0.002, adjust_lr_fn="match_rms_adamw"),
        "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=0.002, fused=True),
    }
    print(f"{torch.get_num_threads()} threads; flags: {vector_flags()}; native bf16: {cpu_has_native_bf16()}")
    for name, make in makers.items():
        print(f"{name:>32}: {step_seconds(make, args.reps) * 1000:8.1f} ms per step", flush=True)


if __name__ == "__main__":
    main()

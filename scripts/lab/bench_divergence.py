"""Cost of the distillation loss, forward and backward, fused (`token_divergence`) against the formulas under
autograd (`token_divergences`, the evaluation path); with `--heads`, the heads recipes' loss instead.

    .venv/bin/python scripts/lab/bench_divergence.py [--rows 880] [--vocab 49152] [--reps 5]
    .venv/bin/python scripts/lab/bench_divergence.py --heads [--rows 2400] [--vocab 8192] [--reps 12]

Prints the median seconds of loss + backward for each divergence and both ways, timed interleaved so drift hits
both alike, and their ratio. The defaults are one step of the CPU distill recipe: 4 conversations of 320 tokens
hold about 880 assistant positions, over SmolLM2's 49152-token vocabulary. `--heads` times the heads recipes'
soft cross-entropy with its top-1 agreement on bf16 logits (a P-EAGLE step of the CPU recipe scores about 2400
entries over its 8192-token draft vocabulary), fused (`soft_cross_entropy`) against autograd's softmax, log-softmax
and product with two argmaxes; the ratio is the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specheads.train.divergence import DIVERGENCES, soft_cross_entropy, token_divergence, token_divergences


def seconds(fused: bool, name: str, target: torch.Tensor, draft: torch.Tensor) -> float:
    start = time.perf_counter()
    if fused:
        loss = token_divergence(name, target, draft)
    else:
        loss = token_divergences((name,), target, draft)[name]
    loss.mean().backward()
    draft.grad = None
    return time.perf_counter() - start


def heads_loss_seconds(fused: bool, target: torch.Tensor, draft: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = draft.bfloat16()  # the head's logits under autocast
    if fused:
        ce, agree = soft_cross_entropy(target, logits)
    else:
        target_p = target.float().softmax(-1)
        logits = logits.float()
        ce = -(target_p * logits.log_softmax(-1)).sum(-1)
        with torch.no_grad():
            agree = logits.argmax(-1) == target_p.argmax(-1)
    ce.mean().backward()
    float(agree.float().mean())  # the step's top-1 statistic
    draft.grad = None
    return time.perf_counter() - start


def heads(args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(0)
    target = (torch.randn(args.rows, args.vocab, generator=generator) * 3).bfloat16()
    draft = (torch.randn(args.rows, args.vocab, generator=generator) * 3).requires_grad_(True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.reps + 1):  # the first round warms up
        for fused in (True, False):
            times[fused].append(heads_loss_seconds(fused, target, draft))
    fused, formulas = times[True][1:], times[False][1:]
    ratio = statistics.median(f / a for f, a in zip(fused, formulas))
    print(f"heads loss + backward + top-1, [{args.rows}, {args.vocab}] bf16 logits, {torch.get_num_threads()} "
          f"threads, median of {args.reps}: fused {statistics.median(fused):.3f} s, autograd "
          f"{statistics.median(formulas):.3f} s, fused / autograd {ratio:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=None, help="scored positions (default 880, --heads 2400)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 49152, --heads 8192)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 5, --heads 12)")
    p.add_argument("--heads", action="store_true", help="time the heads recipes' loss instead")
    args = p.parse_args()
    if args.heads:
        args.rows, args.vocab, args.reps = args.rows or 2400, args.vocab or 8192, args.reps or 12
        heads(args)
        return
    args.rows, args.vocab, args.reps = args.rows or 880, args.vocab or 49152, args.reps or 5
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

"""Feature caching one conversation per forward against batches of similar length (`write_feature_cache`'s
`batch_tokens`), on the default target and the main job's data.

    .venv/bin/python scripts/lab/bench_feature_cache.py [--conversations 96] [--rounds 3] [--batch-tokens 4096]

Caches the same conversations (ShareGPT, the CPU recipe's max_length of 320 and aux layers 2, 15, 27) both ways,
rounds interleaved so drift hits both alike, under the autocast the recipe uses (bf16 where the CPU has native
bf16), and prints conversations per second of each and the median per-round ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch

from specheads.machine import cpu_has_native_bf16
from specheads.target import load_target
from specheads.train.data import load_conversations, tokenize_dataset
from specheads.train.feature_cache import write_feature_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=4096)
    args = p.parse_args()
    target, tokenizer = load_target("default")
    conversations, _ = load_conversations("sharegpt", max_conversations=args.conversations)
    ids = list(tokenize_dataset(conversations, tokenizer, 320)["input_ids"])
    bf16 = cpu_has_native_bf16()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times: dict[int, list[float]] = {1: [], args.batch_tokens: []}
    with autocast, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for batch_tokens in times:
                start = time.perf_counter()
                write_feature_cache(target, ids, f"{tmp}/{r}-{batch_tokens}", target_name="default",
                                    aux_layers=(2, 15, 27), batch_tokens=batch_tokens)
                times[batch_tokens].append(time.perf_counter() - start)
    one, many = times[1], times[args.batch_tokens]
    print(f"{len(ids)} conversations, {sum(map(len, ids))} tokens, {'bf16 autocast' if bf16 else 'fp32'}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"one per forward: {len(ids) / statistics.median(one):.2f} conv/s; batches of <= {args.batch_tokens} "
          f"tokens: {len(ids) / statistics.median(many):.2f} conv/s; time ratio batched / one "
          f"{statistics.median(b / a for a, b in zip(one, many)):.2f}")


if __name__ == "__main__":
    main()

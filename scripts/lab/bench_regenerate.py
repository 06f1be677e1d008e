"""Which regenerates the training answers faster here: the target in this process (HF `generate`, batched) or
`llama-server` on the target's GGUF with N slots (OpenAI endpoint, N conversations in flight).

    .venv/bin/python scripts/lab/bench_regenerate.py --conversations 16 --max-new-tokens 128 --slots 1,4,8,16

Each way answers the same first turns of the same ShareGPT conversations greedily (fp32 target, F32 GGUF with an f32
cache); printed: generated tokens per second of wall time, and how many answers equal the first way's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from specheads.llamacpp.server import LlamaServer
from specheads.llamacpp.target_gguf import target_gguf
from specheads.target import load_target, stop_token_ids
from specheads.train.data import load_conversations
from specheads.train.endpoint import Endpoint, EndpointAnswerer
from specheads.train.regenerate import TargetAnswerer, regenerate


def timed(conversations: list, answerer) -> tuple[float, list]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = regenerate(conversations, Path(tmp), answerer, max_turns=1)
        wall = time.perf_counter() - start
        rows = Path(report.joined).read_text().splitlines()
    return wall, rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--skip", type=int, default=5000, help="conversations passed over (not those training reads)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slots", default="1,4,8,16")
    p.add_argument("--hf-batch", type=int, default=16)
    args = p.parse_args()
    ds, _ = load_conversations("sharegpt", max_conversations=args.conversations, skip_conversations=args.skip)
    conversations = ds["messages"]
    model, tokenizer = load_target("default", dtype="float32")
    ways = {}
    answerer = TargetAnswerer(model, tokenizer, batch_size=args.hf_batch, max_new_tokens=args.max_new_tokens,
                              stop_ids=stop_token_ids(tokenizer, model))
    ways[f"hf generate, batch {args.hf_batch}"] = timed(conversations, answerer)
    gguf = target_gguf("default", "f32")
    for slots in (int(s) for s in args.slots.split(",")):
        with LlamaServer(gguf, cache_type="f32", slots=slots, ctx_size=2048) as server:
            answerer = EndpointAnswerer(Endpoint(server.url, concurrency=slots),
                                        max_new_tokens=args.max_new_tokens)
            try:
                ways[f"llama-server, {slots} slots"] = timed(conversations, answerer)
            finally:
                answerer.close()
    first = next(iter(ways.values()))[1]
    for name, (wall, rows) in ways.items():
        tokens = sum(len(tokenizer(r)["input_ids"]) for r in rows)  # the joined rows' text, a proxy of answers
        same = sum(a == b for a, b in zip(rows, first))
        print(f"{name}: {wall:.1f} s, {len(rows)} conversations, {same} equal to the first way's, "
              f"{tokens / wall:.0f} tokens of conversation per s")


if __name__ == "__main__":
    main()

"""Step costs of a large model shape built on the device with random weights: the engine's one-token step and its
N-node verify steps, eager and graphed, and HF `generate`'s per-token cost, each against the time it takes to read
the weights once at the rate this device reads memory.

    python scripts/step_probe.py [--shape llama-3.1-8b] [--device cuda] [--dtype bfloat16] [--nodes 16,64]
        [--tokens 64] [--graphs 1] [--output probe.json]

Acceptance means nothing on random weights; the cost of a step does, and it is what speculation must win back: a
one-token step near the weight-read time leaves little to gain but from drafting, and an N-node verify close to
a one-token step is what makes drafting pay. A step's cost is the difference between a generation of 1 + T tokens
and one of 1 token, over T (prefill and first token cancel out); an N-node step verifies a star of N random tokens
(the root and N - 1 children, none accepted), so every step commits one token. The read rate is that of a
reduction over a buffer the size of the weights (bytes read over seconds, the best of 5). Each figure prints as it
is measured; `--output` gets them all as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.tree import DraftTree
from specheads.inference.proposers import AutoregressiveProposer

SHAPES = {  # LlamaConfig fields of each shape; "tiny" rehearses the probe on a CPU
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}
PROMPT_TOKENS = 128
REPEATS = 3  # each figure is the median of this many measurements


class StarProposer:
    """Drafts N - 1 random children of the root: a verify of N nodes that accepts (almost surely) none."""

    needs_target_hidden = False

    def __init__(self, nodes: int, vocab: int) -> None:
        self.nodes, self.vocab = nodes, vocab
        self.gen = torch.Generator().manual_seed(0)

    def start(self, ctx, hidden) -> None:
        pass

    def on_verified(self, result, hidden) -> None:
        pass

    def propose(self, ctx) -> DraftTree:
        root = ctx.tokens[-1:].cpu()
        kids = torch.randperm(self.vocab, generator=self.gen)[: self.nodes - 1]
        kids = kids[kids != root]  # siblings are distinct from each other; a child equal to the root is dropped
        tokens = torch.cat([root, kids]).to(ctx.tokens.device)
        parents = torch.tensor([-1] + [0] * len(kids), device=ctx.tokens.device)
        return DraftTree(tokens=tokens, parents=parents)


def build(shape: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str) -> float:
    times = []
    for _ in range(REPEATS):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def read_seconds(nbytes: int, device: str, dtype: torch.dtype) -> float:
    """Seconds to read `nbytes` once: a reduction over a buffer that size, the best of 5."""
    buf = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    buf.sum()  # warm-up
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        buf.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    del buf
    return best


def step_seconds(generate: Callable[[int], object], tokens: int, device: str) -> float:
    """Per-token cost: (a generation of 1 + tokens) minus (one of 1), over tokens; both warmed up first."""
    generate(1 + tokens)  # warm-up (and, graphed, the capture of every shape this length meets)
    return (median_seconds(lambda: generate(1 + tokens), device) - median_seconds(lambda: generate(1), device)) / tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--nodes", default="16,64", help="comma list of verify sizes besides the one-token step")
    p.add_argument("--tokens", type=int, default=64, help="tokens per timed generation (default 64)")
    p.add_argument("--graphs", type=int, choices=(0, 1), default=1,
                   help="also time the engine graphed (--compile: CUDA graphs on a GPU; default 1)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--output", help="write every figure to this JSON file")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    nodes = [int(n) for n in args.nodes.split(",") if n]

    started = time.perf_counter()
    model = build(args.shape, args.device, dtype)
    params = sum(w.numel() for w in model.parameters())
    nbytes = sum(w.numel() * w.element_size() for w in model.parameters())
    read = read_seconds(nbytes, args.device, dtype)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    figures: dict = {"shape": args.shape, "device": name, "dtype": args.dtype, "params": params,
                     "weight_bytes": nbytes, "read_ms": 1000 * read, "read_gb_per_s": nbytes / read / 1e9,
                     "build_s": time.perf_counter() - started, "tokens": args.tokens, "steps": {}}
    print(f"{args.shape} on {name}, {args.dtype}: {params / 1e9:.2f}B parameters, {nbytes / 1e9:.2f} GB; reading "
          f"them once takes {1000 * read:.2f} ms ({nbytes / read / 1e9:.0f} GB/s)", flush=True)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()

    def record(label: str, seconds: float) -> None:
        figures["steps"][label] = {"ms": 1000 * seconds, "x_read": seconds / read}
        one = figures["steps"].get(label.split(" ")[0] + " 1-node", {}).get("ms")
        vs_one = f", {1000 * seconds / one:.2f}x its one-token step" if one and not label.endswith(" 1-node") else ""
        print(f"  {label:<24} {1000 * seconds:8.2f} ms/step  {seconds / read:5.2f}x the weight read{vs_one}",
              flush=True)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(figures, f, indent=1)

    for graphed in ([False, True] if args.graphs else [False]):
        mode = "graphed" if graphed else "eager"
        for n in [1, *nodes]:
            proposer = AutoregressiveProposer() if n == 1 else StarProposer(n, vocab)
            engine = Engine(model, proposer, compile=graphed)
            record(f"{mode} {n}-node", step_seconds(
                lambda k, engine=engine: engine.generate(prompt, max_new_tokens=k), args.tokens, args.device))
    if not args.no_hf:
        ids = torch.tensor([prompt], device=args.device)
        with torch.inference_mode():
            record("hf-generate 1-node", step_seconds(
                lambda k: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                         min_new_tokens=k, do_sample=False, pad_token_id=0),
                args.tokens, args.device))
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()

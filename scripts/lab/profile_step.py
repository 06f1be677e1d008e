"""Where a decode step's time goes: a one-token step and a tree verify, split by kind of work.

    .venv/bin/python scripts/lab/profile_step.py [--target default] [--dtype auto] [--nodes 1,16] [--context 256]
        [--steps hf,lean] [--reps 20] [--json OUT.json]

For each tree size (1 = a plain one-token step) and each of the engine's target forwards (`--steps`: the model's
own, `hf`; the lean one, `lean`; the lean one with its decoder layers compiled as one graph, `compiled`; see
inference/engine/lean_forward.py) the forward runs as the engine runs it
(`batch_forward` over a `BatchKVCache` row holding `--context` tokens) under torch.profiler, and each operator's own
time is put in one bucket:

- products: the matrix products (linear layers, the LM head);
- attention: scaled dot-product attention and what it calls;
- cache: everything inside the KV cache's update (writing the new keys and values, growing the buffers);
- norms/elementwise: every other operator (RMSNorm, rotary embeddings, the MLP's activation, residual adds, casts),
  and a compiled graph's own time (its fused kernels);
- python/dispatch: the wall time no operator accounts for (Python, module calls, argument checks, dispatch).

A memory-bandwidth probe then reads a buffer larger than the caches, so the products' time can be set against
what reading the weights once costs on this machine: `weights / bandwidth` is the floor a one-token step
approaches when it is bound by weight reads. Medians over `--reps` interleaved rounds; the profiler's own
overhead inflates the operator times a little, so the buckets are shares of the profiled wall time, beside the
unprofiled wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specheads.inference.engine import batch_cache
from specheads.inference.engine.batch_cache import BatchKVCache
from specheads.inference.engine.forward import batch_forward, prefill_forward
from specheads.inference.engine.lean_forward import LeanForward, target_forward
from specheads.inference.engine.tree import DraftTree
from specheads.target import load_target

CACHE_RANGE = "specheads::cache_update"
COMPILED_GRAPH = "CompiledFxGraph"  # the profiler's event around a torch.compile graph's generated code
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::matmul", "aten::linear", "mkldnn", "onednn",
            "aten::_weight_int8", "quantized::linear")
ATTENTION = ("scaled_dot_product", "flash_attention", "aten::_softmax", "aten::softmax", "aten::baddbmm")
BUCKETS = ("products", "attention", "cache", "norms/elementwise", "python/dispatch")


def _bucket(name: str) -> str:
    if any(key in name for key in PRODUCTS):
        return "products"
    if any(key in name for key in ATTENTION):
        return "attention"
    return "norms/elementwise"


def _in_cache(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == CACHE_RANGE:
            return True
        parent = parent.cpu_parent
    return False


@contextlib.contextmanager
def annotated_cache_updates() -> Iterator[None]:
    """Within: the cache layers' writes (either forward's) run in a profiler range, so their operators are counted as
    cache work."""
    layer = batch_cache._RowsLayer
    write = layer.write

    def annotated(self, *args, **kwargs):
        with record_function(CACHE_RANGE):
            return write(self, *args, **kwargs)

    layer.write = annotated
    try:
        yield
    finally:
        layer.write = write


def split(model, cache: BatchKVCache, tree: DraftTree, lean: LeanForward | None = None) -> dict[str, float]:
    """Seconds per bucket of one profiled forward of `tree` over row 0 (its wall time under `wall`); the forward
    commits nothing, so the cache is left as it was."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        batch_forward(model, cache, [tree], lean=lean)
        wall = time.perf_counter() - start
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if COMPILED_GRAPH in event.name:  # a compiled graph's own time is its fused kernels (elementwise work)
            seconds["norms/elementwise"] += event.self_cpu_time_total / 1e6
            continue
        if event.name == CACHE_RANGE or not event.name.startswith(("aten::", "mkldnn", "onednn", "quantized::")):
            continue
        own = event.self_cpu_time_total / 1e6
        seconds["cache" if _in_cache(event) else _bucket(event.name)] += own
    seconds["python/dispatch"] = max(0.0, wall - sum(seconds.values()))
    seconds["wall"] = wall
    return dict(seconds)


def plain_seconds(model, cache: BatchKVCache, tree: DraftTree, lean: LeanForward | None = None) -> float:
    start = time.perf_counter()
    batch_forward(model, cache, [tree], lean=lean)
    return time.perf_counter() - start


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes per second a reduction over `gib` GiB of fp32 reads, median of `reps` (caches are far smaller)."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()  # first touch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes a one-token step reads from the weights: every matrix a product multiplies by (the LM head once)."""
    seen, total = set(), 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, torch.nn.Embedding):
            if weight.data_ptr() not in seen:
                seen.add(weight.data_ptr())
                total += weight.numel() * weight.element_size()
    head = model.get_output_embeddings().weight
    if head.data_ptr() not in seen:  # a head tied to the embedding is read as a product too
        total += head.numel() * head.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--device", default="cpu", help="cpu only: the profiler buckets are CPU operators")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weight-layout", default="auto")
    p.add_argument("--nodes", default="1,16", help="comma list of tree sizes (1 = a one-token step)")
    p.add_argument("--context", type=int, default=256, help="tokens in the cache before each forward")
    p.add_argument("--steps", default="hf,lean", help="comma list of target forwards: hf (the model's own), lean, "
                                                      "compiled (lean, its decoder layers compiled)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    if args.device != "cpu":
        p.error("--device: the split is of CPU operators; profile a GPU with torch.profiler's CUDA activity instead")
    sizes = [int(n) for n in args.nodes.split(",")]
    model, _ = load_target(args.target, device="cpu", dtype=args.dtype, weight_layout=args.weight_layout)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, vocab, (1, args.context), generator=gen)
    trees = {n: DraftTree(tokens=torch.randint(100, vocab, (n,), generator=gen),
                          parents=torch.tensor([-1] + [0] * (n - 1))) for n in sizes}
    for step in args.steps.split(","):
        if step not in ("hf", "lean", "compiled"):
            p.error(f"--steps: unknown step {step!r}; use hf, lean, compiled")
    # a target the lean forward cannot run is refused here, by name
    steps = {step: target_forward(model, "hf" if step == "hf" else "lean", compile=step == "compiled")
             for step in args.steps.split(",")}
    cache = BatchKVCache(model.config, rows=1, capacity=args.context + max(sizes) + 16)
    cases = [(step, n) for n in sizes for step in steps]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {case: [] for case in cases}
    plain: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    with torch.inference_mode(), annotated_cache_updates():
        cache.add_row()
        prefill_forward(model, cache, 0, context[0])
        cache.commit(0, torch.arange(args.context))
        for rep in range(args.reps + 1):  # round 0 warms up allocators and kernels
            for step, n in cases:
                profiled = split(model, cache, trees[n], steps[step])
                unprofiled = plain_seconds(model, cache, trees[n], steps[step])
                if rep:
                    runs[step, n].append(profiled)
                    plain[step, n].append(unprofiled)
    bandwidth = read_bandwidth()
    weights = weight_bytes(model)
    report = {"dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "context": args.context, "weight_bytes": weights, "read_bandwidth_gb_s": bandwidth / 1e9,
              "weight_read_ms": weights / bandwidth * 1e3, "steps": {}}
    print(f"{report['dtype']}, {report['threads']} threads, {args.context}-token cache; "
          f"weights {weights / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"-> weight read {report['weight_read_ms']:.1f} ms")
    print(f"{'step':>5} {'nodes':>5} {'wall ms':>8} {'profiled':>9} " + " ".join(f"{b:>17}" for b in BUCKETS)
          + f" {'products GB/s':>13}")
    for step, n in cases:
        med = {b: statistics.median(r.get(b, 0.0) for r in runs[step, n]) for b in (*BUCKETS, "wall")}
        wall = statistics.median(plain[step, n])
        shares = {b: med[b] / med["wall"] for b in BUCKETS}
        product_bw = weights / med["products"] / 1e9 if med["products"] else float("nan")
        report["steps"][f"{step}-{n}"] = {"step": step, "nodes": n, "wall_ms": wall * 1e3,
                                          "profiled_ms": med["wall"] * 1e3, "ms": {b: med[b] * 1e3 for b in BUCKETS},
                                          "products_gb_s": product_bw}
        print(f"{step:>5} {n:>5} {wall * 1e3:>8.1f} {med['wall'] * 1e3:>9.1f} "
              + " ".join(f"{med[b] * 1e3:>8.1f} ms {shares[b]:>4.0%}" for b in BUCKETS) + f" {product_bw:>13.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

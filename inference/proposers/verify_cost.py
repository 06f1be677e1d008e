"""What one verify forward costs on this machine, by tree size and batch size.

Speculation pays when the tokens a step commits outgrow what its verify forward costs over a plain
step. That cost is the machine's, not the method's: a GPU verifies 60 nodes for about the price of
one, while on a CPU every node adds GEMM work (figures in docs/results.md).
In a batch every row's input is padded to the widest tree, so the cost of a width is paid by every
row, and the forward turns compute-bound sooner: the curve depends on the batch size.
`VerifyCost` holds one batch size's measured curve; `verify_cost` measures it once per (target,
dtype, layout, device, machine, batch size) and caches it under `specheads_home()/verify-cost/`, so
later runs start at once. `VerifyCosts` gives the curve at any batch size, measuring powers of two
on demand and interpolating between them.

The curve is the forward's the engine runs: our PyTorch forward of the model by default, or another backend's
(`target_backend.py`; llama.cpp's verifies a tree at other relative costs) once the engine says so
(`VerifyCosts.measure_on`), measured the same way on a copy of that backend and cached under its own key.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specheads.cached import specheads_home
from specheads.gemm_layout import layout_plans, linear_layout
from specheads.inference.engine.lean_forward import resolve_step
from specheads.inference.engine.target_backend import TargetBackend
from specheads.inference.engine.tree import DraftTree
from specheads.machine import hardware_name

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class VerifyCost:
    """Median seconds of one verify forward over `nodes[i]` tree nodes (a one-token step first)."""

    nodes: tuple[int, ...]  # increasing, nodes[0] == 1
    seconds: tuple[float, ...]  # same length, > 0

    def __post_init__(self) -> None:
        if not self.nodes or self.nodes[0] != 1 or list(self.nodes) != sorted(set(self.nodes)):
            raise ValueError(f"verify cost needs increasing node counts starting at 1, got {self.nodes}")
        if len(self.seconds) != len(self.nodes) or min(self.seconds) <= 0:
            raise ValueError("verify cost needs one positive time per node count")

    def relative(self, n: int) -> float:
        """Cost of an n-node verify over a one-token step: linear between measured sizes, and beyond the
        largest along its last segment. Never below 1: no tree is cheaper than the plain step it extends."""
        xs, ys = self.nodes, self.seconds
        if n <= xs[0] or len(xs) == 1:
            return 1.0
        i = min(bisect.bisect_left(xs, n), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(1.0, (y0 + (y1 - y0) * (n - x0) / (x1 - x0)) / ys[0])

    def table(self, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """[max(sizes) + 1] fp64: entry n is `relative(n)` (entry 0 unused), for picking budgets on tensors."""
        top = max(sizes) if sizes else self.nodes[-1]
        return torch.tensor([1.0] + [self.relative(n) for n in range(1, top + 1)], dtype=torch.float64)


    def blend(self, other: VerifyCost, w: float) -> VerifyCost:
        """(1 - w) * self + w * other, at every node count either measured."""
        nodes = tuple(sorted({*self.nodes, *other.nodes}))
        seconds = tuple((1 - w) * self._seconds(n) + w * other._seconds(n) for n in nodes)
        return VerifyCost(nodes=nodes, seconds=seconds)

    def _seconds(self, n: int) -> float:
        return self.relative(n) * self.seconds[0]


@torch.inference_mode()
def measure_verify_cost(model: PreTrainedModel, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 3,
                        context: int = 128, batch: int = 1) -> VerifyCost:
    """Time star-shaped trees of each size over a `context`-token cache, `reps` interleaved rounds, medians; with
    `batch` > 1, one such tree in each of `batch` rows of one padded forward, as the engine verifies a batch.

    The cost depends on the node count, not the shape; interleaving spreads machine drift over all sizes.
    """
    # Imported here: the engine imports every proposer, and the proposers import this module.
    from specheads.inference.engine.batch_cache import BatchKVCache
    from specheads.inference.engine.forward import batch_forward, prefill_forward
    from specheads.inference.engine.lean_forward import target_forward

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    sizes = sorted({1, *sizes})
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, context), generator=gen)
    trees = {n: DraftTree(tokens=torch.randint(0, vocab, (n,), generator=gen),
                          parents=torch.tensor([-1] + [0] * (n - 1))) for n in sizes}
    capacity = context + max(sizes) + 16
    # the forward the engine runs on this model by default (`step="auto"`), over rows as the engine keeps them; a
    # forward writes its rows' entries past their lengths and commits nothing, so it can be repeated as is
    lean = target_forward(model)
    rows = BatchKVCache(model.config, rows=batch, capacity=capacity)
    for prompt in prompts:
        row = rows.add_row()
        prefill_forward(model, rows, row, prompt, lean=lean)
        rows.commit(row, torch.arange(context))

    def forward(tree: DraftTree) -> None:
        batch_forward(model, rows, [tree] * batch, lean=lean)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 1):  # round 0 warms up allocators and kernels
        for n in sizes:
            device_sync(device)
            start = time.perf_counter()
            forward(trees[n])
            device_sync(device)
            if rep:
                times[n].append(time.perf_counter() - start)
    return VerifyCost(nodes=tuple(sizes), seconds=tuple(statistics.median(times[n]) for n in sizes))


def measure_backend_verify_cost(backend: TargetBackend, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 3,
                                context: int = 128, batch: int = 1) -> VerifyCost:
    """`measure_verify_cost` on another backend: a fresh copy of `backend` with `batch` rows, the same star trees over
    the same `context`, each verify followed by a commit of its root (one more committed token: the context grows by
    one a forward, which no size favours, as the sizes are interleaved)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    sizes = sorted({1, *sizes})
    copy = backend.measurement_copy(batch, context + (reps + 1) * len(sizes) + max(sizes) + 16)
    gen = torch.Generator().manual_seed(0)
    vocab = copy.vocab_size
    for _ in range(batch):
        row = copy.add_row(context + (reps + 1) * len(sizes) + max(sizes) + 1)
        copy.prefill(row, torch.randint(0, vocab, (context,), generator=gen), hidden=False)
        copy.commit(row, torch.tensor([0]))
    trees = {n: DraftTree(tokens=torch.randint(0, vocab, (n,), generator=gen),
                          parents=torch.tensor([-1] + [0] * (n - 1))) for n in sizes}
    root = torch.tensor([0])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 1):  # round 0 warms up allocators and kernels
        for n in sizes:
            start = time.perf_counter()
            copy.verify(0, [trees[n]] * batch, hidden=False)
            if rep:
                times[n].append(time.perf_counter() - start)
            for row in range(batch):
                copy.commit(row, root)
    return VerifyCost(nodes=tuple(sizes), seconds=tuple(statistics.median(times[n]) for n in sizes))


def default_cache_dir() -> Path:
    return specheads_home() / "verify-cost"


# A cached curve is measured again when it is older than this (a machine's libraries and load change) ...
MAX_AGE_S = 30 * 24 * 3600.0
# ... or when a quick check now (a one-token step and a 4-node verify) finds it this much slower or steeper than the
# machine is today: such a curve was measured while something else ran, and would keep cutting every tree. A check
# that finds the machine slower than its cached curve keeps the curve: re-measuring on a busy machine is the error.
CHECK_SIZES = (1, 4)
DRIFT = 1.3


def verify_cost(model: PreTrainedModel | TargetBackend, cache_dir: Path | None = None, batch: int = 1,
                **measure) -> VerifyCost:
    """The verify cost on this machine at `batch` rows of the model's (our PyTorch forward) or of a backend's forward:
    read from the cache (checked against a quick measurement, and aged out after `MAX_AGE_S`), or measured (a few
    seconds) and cached."""
    path = _cache_path(model, cache_dir, batch)
    cached, why = _cached(path), "once"
    if cached is not None:
        cost, measured_at = cached
        if measured_at is not None and time.time() - measured_at > MAX_AGE_S:
            why = f"again: the cached curve is {(time.time() - measured_at) / 86400:.0f} days old"
        elif (stale := _stale(cost, model, batch)) is None:
            return cost
        else:
            why = f"again: {stale}"
            log.warning("the cached verify cost in %s %s; measuring it again", path, stale)
    log.info("measuring the target's verify cost by tree size at batch %d on this machine (%s; cached in %s)",
             batch, why, path.parent)
    cost = _measure(model, batch=batch, **measure)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(cost), "measured_at": time.time()}), encoding="utf-8")
    tmp.replace(path)
    return cost


def _measure(source: PreTrainedModel | TargetBackend, **measure) -> VerifyCost:
    if isinstance(source, PreTrainedModel):
        return measure_verify_cost(source, **measure)
    return measure_backend_verify_cost(source, **measure)


def _cache_path(model: PreTrainedModel | TargetBackend, cache_dir: Path | None, batch: int) -> Path:
    key = machine_key(model) if isinstance(model, PreTrainedModel) else forward_key(None, model)
    name = key + (f"-batch{batch}" if batch > 1 else "")
    return (cache_dir or default_cache_dir()) / f"{name}.json"


def cached_verify_cost(model: PreTrainedModel, batch: int = 1,
                       cache_dir: Path | None = None) -> tuple[VerifyCost, float | None] | None:
    """The curve this machine has cached for `model` at `batch` rows, and when it was measured (None: none cached);
    measures nothing, for reports of what a run used."""
    return _cached(_cache_path(model, cache_dir, batch))


def _cached(path: Path) -> tuple[VerifyCost, float | None] | None:
    """(curve, when it was measured or None where the entry predates the field); None when absent or damaged (a
    damaged entry is measured again and overwritten)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        cost = VerifyCost(nodes=tuple(data["nodes"]), seconds=tuple(data["seconds"]))
        measured_at = data.get("measured_at")
        return cost, float(measured_at) if measured_at is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _stale(cost: VerifyCost, model: PreTrainedModel | TargetBackend, batch: int) -> str | None:
    """Why the cached `cost` is not this machine's today, or None: a quick measurement of a one-token step and a
    4-node verify finds the cached step more than DRIFT times slower, or the cached 4-node verify more than DRIFT
    times dearer relative to it."""
    now = _measure(model, sizes=CHECK_SIZES, reps=2, batch=batch)
    n = CHECK_SIZES[-1]
    if cost.seconds[0] > DRIFT * now.seconds[0]:
        return (f"has a one-token step of {cost.seconds[0] * 1000:.1f} ms where one takes {now.seconds[0] * 1000:.1f} "
                "ms now (measured while the machine was busy)")
    if cost.relative(n) > DRIFT * now.relative(n):
        return (f"has a {n}-node verify at {cost.relative(n):.2f}x a step where it costs {now.relative(n):.2f}x now "
                "(measured while the machine was busy)")
    return None


class VerifyCosts:
    """The verify cost curve at any batch size: measured (or read from the cache) at the powers of two around it,
    on first use, and interpolated linearly between them."""

    def __init__(self, model: PreTrainedModel | None = None, *, fixed: VerifyCost | None = None,
                 cache_dir: Path | None = None) -> None:
        if (model is None) == (fixed is None):
            raise ValueError("VerifyCosts needs a model to measure or one fixed curve")
        self.model: PreTrainedModel | TargetBackend | None = model
        self.cache_dir, self.fixed = cache_dir, fixed
        self._measured: dict[int, VerifyCost] = {}
        self._at: dict[int, VerifyCost] = {}

    def measure_on(self, backend: TargetBackend) -> None:
        """Trees are verified on `backend`: measure its forward from now on (our PyTorch backend is the model's own,
        which a model-made curve already measures)."""
        if self.fixed is None and backend.name != "torch":
            self.model = backend
            self._measured.clear()
            self._at.clear()

    def _power(self, batch: int) -> VerifyCost:
        if self.fixed is not None:
            return self.fixed
        if batch not in self._measured:
            self._measured[batch] = verify_cost(self.model, cache_dir=self.cache_dir, batch=batch)
        return self._measured[batch]

    def at(self, batch: int) -> VerifyCost:
        """The curve at `batch` rows (>= 1)."""
        if batch not in self._at:
            low = 1 << (max(batch, 1).bit_length() - 1)
            cost = self._power(low)
            if batch > low:
                cost = cost.blend(self._power(2 * low), (batch - low) / low)
            self._at[batch] = cost
        return self._at[batch]


def prepare_verify_costs(model: PreTrainedModel | TargetBackend, max_batch: int, cache_dir: Path | None = None) -> None:
    """Measure (once per machine; cached) the curves a batch of up to `max_batch` rows reads, so that no step of a
    server or a calibration stops to measure one."""
    batch = 1
    while True:
        verify_cost(model, cache_dir=cache_dir, batch=batch)
        if batch >= max_batch:
            return
        batch *= 2


def forward_key(model: PreTrainedModel, backend: TargetBackend | None = None) -> str:
    """`machine_key` of our PyTorch forward of `model`, or what another backend's step costs depend on."""
    return machine_key(model) if backend is None or backend.name == "torch" else f"{backend.name}-{backend.cost_key()}"


def forward_description(model: PreTrainedModel, backend: TargetBackend | None = None) -> str:
    """`machine_description`, or another backend's own."""
    return machine_description(model) if backend is None or backend.name == "torch" else backend.describe()


def machine_key(model: PreTrainedModel) -> str:
    """What step costs depend on: the model's shapes, dtype, weight layout and kernel plans, forward (lean or HF),
    device, threads and software."""
    parts = [model.config.to_json_string(use_diff=False), str(model.dtype), linear_layout(model),
             repr(sorted(layout_plans(model).items())), resolve_step("auto", model), *_setting(model)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def machine_description(model: PreTrainedModel) -> str:
    """The same setting in words, for people (the key's model shapes aside)."""
    device_type, hardware, threads, version = _setting(model)
    return (f"{type(model).__name__} {model.dtype} ({linear_layout(model)} layout) on {hardware} ({device_type}, "
            f"{threads} threads, torch {version})")


def _setting(model: PreTrainedModel) -> tuple[str, str, str, str]:
    device = next(model.parameters()).device
    hardware = hardware_name(device)
    return device.type, hardware, str(torch.get_num_threads()), torch.__version__


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""`specheads calibrate`: measure where speculation pays for one target and method on this machine.

For each batch size b, b prompts decode together in one engine, once with every row speculating and once with
every row plain (the proposer still following the text, as between adaptive probes), in interleaved rounds so
machine drift spreads over both. Each run times `steps` engine steps once every row is past its prefill and first
draft, and keeps the medians: `t_spec(b)`, `t_plain(b)`, and the speculative steps' τ and per-position acceptance.
The result is a `SpeculationProfile` (`adaptive.py`) that `specheads serve --speculation adaptive` reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from transformers import PreTrainedModel

from specheads.inference.adaptive import BatchCost, NeverSpeculate, SpeculationProfile
from specheads.inference.engine import Engine
from specheads.inference.proposers.base import Proposer
from specheads.inference.verify_cost import device_sync, machine_description, machine_key

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)


def calibrate(
    model: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    *,
    method: str,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    steps: int = 12,
    rounds: int = 2,
    progress: Callable[[str], None] | None = None,
) -> SpeculationProfile:
    """Time speculative and plain engine steps at each batch size (`steps` per run, `rounds` interleaved runs of
    each). Batch b decodes prompts[i % len(prompts)] for its rows, shifted by b each round so rounds see other
    text. `progress` is told of each run as it starts."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got steps={steps}, rounds={rounds}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    times: dict[tuple[int, bool], list[float]] = {(b, spec): [] for b in sizes for spec in (False, True)}
    committed = {b: 0 for b in sizes}  # tokens the speculative runs committed, over their row-steps
    row_steps = {b: 0 for b in sizes}
    reached: dict[int, list[int]] = {b: [] for b in sizes}  # [i]: speculative row-steps accepting >= i + 1 tokens
    depths: dict[int, list[int]] = {b: [] for b in sizes}  # drafted tree depth of each speculative row-step
    for r in range(rounds):
        for b in sizes:
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}, batch {b}, {'speculative' if spec else 'plain'}")
                rows = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
                run = _time_steps(model, proposer, rows, steps, spec)
                times[b, spec] += run.seconds
                if spec:
                    committed[b] += run.committed
                    row_steps[b] += run.row_steps
                    for i, n in enumerate(run.reached):
                        if i >= len(reached[b]):
                            reached[b].append(0)
                        reached[b][i] += n
                    depths[b] += run.depths
    costs = tuple(
        BatchCost(batch=b, plain_step_s=statistics.median(times[b, False]), spec_step_s=statistics.median(times[b, True]),
                  tau=committed[b] / row_steps[b],
                  accept_per_position=tuple(round(n / row_steps[b], 4) for n in reached[b]),
                  mean_depth=statistics.fmean(depths[b]) if depths[b] else 0.0)
        for b in sizes)
    return SpeculationProfile(method=method, machine_key=machine_key(model), machine=machine_description(model),
                              costs=costs, created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


class _Run:
    def __init__(self) -> None:
        self.seconds: list[float] = []  # each timed step
        self.committed = 0  # tokens committed in the timed steps, all rows
        self.row_steps = 0
        self.reached: list[int] = []
        self.depths: list[int] = []


def _time_steps(model: PreTrainedModel, proposer: Proposer, prompts: list[Sequence[int]], steps: int,
                spec: bool) -> _Run:
    """`steps` timed engine steps over `prompts` decoding together (no stop tokens, so no row ends early)."""
    engine = Engine(model, proposer, max_rows=len(prompts), speculation=None if spec else NeverSpeculate())
    seqs = [engine.add(p, max_new_tokens=16 * (steps + 2)) for p in prompts]
    engine.step()  # prefill every row
    engine.step()  # the first draft (a proposer's start-up work) stays out of the timing
    run = _Run()
    device = engine.device
    for _ in range(steps):
        if any(s.done for s in seqs):
            break
        before = [s.stats.accepted for s in seqs]
        device_sync(device)
        start = time.perf_counter()
        engine.step()
        device_sync(device)
        run.seconds.append(time.perf_counter() - start)
        for seq, had in zip(seqs, before):
            accepted = seq.stats.accepted - had
            run.committed += accepted + 1
            run.row_steps += 1
            run.depths.append(seq.tree.max_depth)
            run.reached += [0] * max(0, accepted - len(run.reached))
            for i in range(accepted):
                run.reached[i] += 1
    if not run.seconds:
        raise ValueError("the calibration prompts ended before any step was timed; use longer prompts or a "
                         "model with a longer context")
    return run

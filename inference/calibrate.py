"""`specheads calibrate`: measure where speculation pays for one target and method on this machine.

First every prompt is decoded speculatively for a while, which gives the drafter's τ, per-position acceptance and
draft depth on this text (a row drafts in a batch exactly what it drafts alone, so these hold at any batch size).
Then, for each batch size b, b prompts decode together in one engine, once with every row speculating and once
with every row plain (the proposer still following the text, as between adaptive probes), in interleaved rounds
so machine drift spreads over both; each run times `steps` engine steps once every row is past its prefill and
first draft, and the medians are `t_spec(b)` and `t_plain(b)`. The result is a `SpeculationProfile`
(`adaptive.py`) that `specheads serve --speculation adaptive` reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from transformers import PreTrainedModel

from specheads.inference.adaptive import (
    AlwaysSpeculate,
    BatchCost,
    NeverSpeculate,
    RowState,
    SpeculationProfile,
)
from specheads.inference.engine import Engine
from specheads.inference.proposers.base import Proposer
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult
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
    acceptance_tokens: int = 64,
    progress: Callable[[str], None] | None = None,
) -> SpeculationProfile:
    """Measure the drafter's acceptance on every prompt (`acceptance_tokens` new tokens each, speculating), then
    time speculative and plain steps at each batch size (`steps` per run, `rounds` interleaved runs of each; batch b
    decodes prompts[i % len(prompts)] for its rows, shifted by b each round so rounds see other text). `progress` is
    told of each run as it starts."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if steps < 1 or rounds < 1 or acceptance_tokens < 2:
        raise ValueError(f"steps and rounds must be >= 1 and acceptance_tokens >= 2, got steps={steps}, "
                         f"rounds={rounds}, acceptance_tokens={acceptance_tokens}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if progress is not None:
        progress(f"acceptance on {len(prompts)} prompts")
    log = _AcceptanceLog()
    engine = Engine(model, proposer, max_rows=min(len(prompts), sizes[-1]), speculation=log)
    seqs = [engine.add(p, max_new_tokens=acceptance_tokens) for p in prompts]
    while any(not s.done for s in seqs):
        engine.step()
    times: dict[tuple[int, bool], list[float]] = {(b, spec): [] for b in sizes for spec in (False, True)}
    for r in range(rounds):
        for b in sizes:
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}, batch {b}, {'speculative' if spec else 'plain'}")
                rows = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
                times[b, spec] += _time_steps(model, proposer, rows, steps, spec)
    n = len(log.tokens)
    deepest = max(log.accepted, default=0)
    return SpeculationProfile(
        method=method, machine_key=machine_key(model), machine=machine_description(model),
        tau=statistics.fmean(log.tokens),
        accept_per_position=tuple(round(sum(a > i for a in log.accepted) / n, 4) for i in range(deepest)),
        mean_depth=statistics.fmean(log.depths),
        costs=tuple(BatchCost(batch=b, plain_step_s=statistics.median(times[b, False]),
                              spec_step_s=statistics.median(times[b, True])) for b in sizes),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


class _AcceptanceLog(AlwaysSpeculate):
    """Speculates every step and records each step after the prefill: tokens committed, drafts accepted, depth."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.accepted: list[int] = []
        self.depths: list[int] = []
        self._prefilled: set[int] = set()

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        if id(row) not in self._prefilled:  # the prefill's root-only step
            self._prefilled.add(id(row))
            return
        self.tokens.append(result.num_accepted + 1)
        self.accepted.append(result.num_accepted)
        self.depths.append(tree.max_depth)


def _time_steps(model: PreTrainedModel, proposer: Proposer, prompts: list[Sequence[int]], steps: int,
                spec: bool) -> list[float]:
    """The times of `steps` engine steps over `prompts` decoding together (no stop tokens, so no row ends early)."""
    engine = Engine(model, proposer, max_rows=len(prompts), speculation=None if spec else NeverSpeculate())
    seqs = [engine.add(p, max_new_tokens=16 * (steps + 2)) for p in prompts]
    engine.step()  # prefill every row
    engine.step()  # the first draft (a proposer's start-up work) stays out of the timing
    seconds = []
    for _ in range(steps):
        if any(s.done for s in seqs):
            break
        device_sync(engine.device)
        start = time.perf_counter()
        engine.step()
        device_sync(engine.device)
        seconds.append(time.perf_counter() - start)
    engine.abort()  # the rows end here: their proposers free what they hold (e.g. rows of a shared head cache)
    if not seconds:
        raise ValueError("the calibration prompts ended before any step was timed; use a model with a longer context")
    return seconds

"""`specheads calibrate`: measure where speculation pays for one target and method on this machine.

For each batch size b, b prompts decode together in one engine, once with every row speculating and once with
every row plain (the proposer still following the text, as between adaptive probes), alternating which goes
first; each run times `steps` engine steps once every row is past its prefill and first draft, and every prompt
takes a turn at every batch size. `t_spec(b)` and `t_plain(b)` are the medians over runs of each run's mean step
time (a mean within a run, since throughput is tokens over total time and a drafter that drafts on a third of the
steps would make a speculative step's median a plain step's; a median over runs, so one disturbed run does not
move it); τ, the per-position acceptance
and the draft depth come from the same timed speculative steps. The result is a `SpeculationProfile`
(`adaptive.py`) that `specheads serve --speculation adaptive` reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from transformers import PreTrainedModel

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import Proposer
from specheads.inference.engine.speculation import AlwaysSpeculate, NeverSpeculate, RowState
from specheads.inference.engine.target_backend import TargetBackend
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.proposers.verify_cost import device_sync, forward_description, forward_key
from specheads.inference.serve.adaptive import BatchCost, SpeculationProfile

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)


def calibrate(
    model: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    *,
    method: str,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    steps: int = 24,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
    step: str = "auto",
    compile: bool = False,
    backend_for: Callable[[int], TargetBackend] | None = None,
) -> SpeculationProfile:
    """Time `steps` speculative and `steps` plain engine steps per run at each batch size. Batch b runs
    max(rounds, ceil(len(prompts) / b)) times, run r decoding prompts[(r * b + i) % len(prompts)] for its rows, so
    every batch size sees every prompt; the modes alternate which goes first. τ, the per-position acceptance and the
    draft depth come from the timed speculative steps (a row drafts in a batch what it drafts alone, so they pool
    over batch sizes, and they describe the same stretch of text the step times do). `step` and `compile` set the
    engine's target forward (`Engine`'s arguments), as the server will run it; `backend_for(rows)`, when given, makes
    a fresh backend of that many rows for each run instead (llama.cpp's), and the profile is that backend's.
    `progress` is told of each batch size as it starts."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got steps={steps}, rounds={rounds}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    times: dict[tuple[int, bool], list[float]] = {(b, spec): [] for b in sizes for spec in (False, True)}  # run means
    log = _AcceptanceLog()
    for b in sizes:
        runs = max(rounds, -(-len(prompts) // b))
        if progress is not None:
            progress(f"batch {b}: {runs} runs of each mode")
        for r in range(runs):
            rows = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                seconds = _time_steps(model, proposer, rows, steps, log if spec else NeverSpeculate(), step,
                                      compile, backend_for)
                times[b, spec].append(statistics.fmean(seconds))
    n = len(log.tokens)
    deepest = max(log.accepted, default=0)
    backend = backend_for(1) if backend_for is not None else None
    return SpeculationProfile(
        method=method, machine_key=forward_key(model, backend), machine=forward_description(model, backend),
        tau=statistics.fmean(log.tokens),
        accept_per_position=tuple(round(sum(a > i for a in log.accepted) / n, 4) for i in range(deepest)),
        mean_depth=statistics.fmean(log.depths),
        costs=tuple(BatchCost(batch=b, plain_step_s=statistics.median(times[b, False]),
                              spec_step_s=statistics.median(times[b, True])) for b in sizes),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


class _AcceptanceLog(AlwaysSpeculate):
    """Speculates every step; while `timing`, records each step: tokens committed, drafts accepted, tree depth."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.accepted: list[int] = []
        self.depths: list[int] = []
        self.timing = False

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        if self.timing:
            self.tokens.append(result.num_accepted + 1)
            self.accepted.append(result.num_accepted)
            self.depths.append(tree.max_depth)


def _time_steps(model: PreTrainedModel, proposer: Proposer, prompts: list[Sequence[int]], steps: int,
                policy: AlwaysSpeculate, step: str, compile: bool,
                backend_for: Callable[[int], TargetBackend] | None) -> list[float]:
    """The times of `steps` engine steps over `prompts` decoding together (no stop tokens, so no row ends early)."""
    if backend_for is not None:
        engine = Engine(model, proposer, max_rows=len(prompts), speculation=policy,
                        backend=backend_for(len(prompts)))
    else:
        engine = Engine(model, proposer, max_rows=len(prompts), speculation=policy, step=step, compile=compile)
    seqs = [engine.add(p, max_new_tokens=16 * (steps + 2)) for p in prompts]
    engine.step()  # prefill every row
    engine.step()  # the first draft (a proposer's start-up work) stays out of the timing
    seconds = []
    timed = isinstance(policy, _AcceptanceLog)
    for _ in range(steps):
        if any(s.done for s in seqs):
            break
        device_sync(engine.device)
        if timed:
            policy.timing = True
        start = time.perf_counter()
        engine.step()
        device_sync(engine.device)
        seconds.append(time.perf_counter() - start)
        if timed:
            policy.timing = False
    engine.abort()  # the rows end here: their proposers free what they hold (e.g. rows of a shared head cache)
    if not seconds:
        raise ValueError("the calibration prompts ended before any step was timed; use a model with a longer context")
    return seconds

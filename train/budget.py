"""A training budget in steps, in minutes, or both: when the run stops and how its learning rate anneals.

The LR rises linearly over `warmup_steps`, then decays (cosine or linear) to 0 at the end of the budget. With
`max_steps` alone the end is a step count, as in every trainer. With `max_minutes` the end is also a wall-clock
time: the decay follows whichever of the two is further along, so a run cut short by its minutes ends annealed
instead of at a high rate mid-schedule (a run stopped at 30% of a cosine schedule keeps about 80% of its peak
rate, and its last steps' noise with it). The same recipe then trains as many steps as the machine affords in the
time given: fewer on a CPU without native bf16, many more on a GPU, each ending where its schedule ends.

Time counts the training loop (steps, evaluations, checkpoints), not the target's load, data or feature cache;
a resumed run goes on from the minutes its checkpoint recorded. Every process reads the main process's clock, so
all of them take the same rate and stop at the same step. A time budget makes the step count, and so the result,
depend on the machine: for a run to repeat exactly, give `max_steps` alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

SHAPES: dict[str, Callable[[float], float]] = {  # the decay after the warmup, over progress 0 -> 1
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "linear": lambda p: 1.0 - p,
}


class TrainingClock:
    """Minutes of training used, as the main process counts them, and the share of the decay they have spent.

    `sync` turns the main process's reading into every process's (a broadcast; identity on one process)."""

    def __init__(self, max_minutes: float | None, *, sync: Callable[[float], float] = lambda minutes: minutes) -> None:
        self.max_minutes = max_minutes
        self._sync = sync
        self.used = 0.0  # minutes used at the last `tick`
        self.warmup_end: float | None = None  # minutes used when the warmup ended (None: not yet)
        self._before, self._start = 0.0, time.monotonic()

    def resume(self, used: float = 0.0, warmup_end: float | None = None) -> None:
        """Go on from a checkpoint's `state()`."""
        self.used, self.warmup_end = used, warmup_end

    def start(self) -> None:
        """Count from now, on top of the minutes already used (the training loop begins)."""
        self._before, self._start = self.used, time.monotonic()

    def tick(self) -> float:
        """Read the clock (once per optimizer step, on every process alike); the minutes used."""
        if self.max_minutes is not None:  # without a time budget nothing reads it: no collective per step
            self.used = self._sync(self._before + (time.monotonic() - self._start) / 60.0)
        return self.used

    def run_progress(self, step: int, max_steps: int) -> float:
        """The share of the run's budget spent before optimizer step `step` (0: the first), in [0, 1]: by steps or by
        minutes, whichever is further along (the LR decay's rule, counted here from the run's start)."""
        by_minutes = 0.0 if self.max_minutes is None else self.used / self.max_minutes
        return min(1.0, max(step / max(1, max_steps), by_minutes))

    def end_warmup(self) -> None:
        if self.warmup_end is None:
            self.warmup_end = self.used

    @property
    def spent(self) -> bool:
        return self.max_minutes is not None and self.used >= self.max_minutes

    def decay_progress(self) -> float:
        """The share of the decay the minutes have spent: 0 at the warmup's end, 1 at `max_minutes`."""
        if self.max_minutes is None or self.warmup_end is None:
            return 0.0
        left = self.max_minutes - self.warmup_end
        return 1.0 if left <= 0 else (self.used - self.warmup_end) / left

    def state(self) -> dict[str, float | None]:
        """What a checkpoint keeps of the clock (`resume(**state)` goes on from it)."""
        return {"used": self.used, "warmup_end": self.warmup_end}


def budget_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, max_steps: int, shape: str,
                    clock: TrainingClock) -> LambdaLR:
    """Linear warmup over `warmup_steps`, then `shape`'s decay to 0 at `max_steps` or at the clock's
    `max_minutes`, whichever is further along (without minutes: transformers' warmup schedules, value for value)."""
    decay = SHAPES[shape]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        clock.end_warmup()
        by_steps = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return max(0.0, decay(min(1.0, max(by_steps, clock.decay_progress()))))

    return LambdaLR(optimizer, factor)

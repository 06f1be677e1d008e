"""The training budget: transformers' warmup schedules value for value without minutes; with minutes, a decay that
follows the clock from the warmup's end to 0 at `max_minutes`, a stop there, a clock a checkpoint resumes, and the
share of the run spent."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from specheads.train import budget
from specheads.train.budget import TrainingClock, budget_schedule


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def rates(scheduler, steps: int, before_step=lambda step: None) -> list[float]:
    out = [scheduler.get_last_lr()[0]]
    for step in range(1, steps + 1):
        before_step(step)
        scheduler.optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


@pytest.mark.parametrize(("shape", "reference"), [("cosine", get_cosine_schedule_with_warmup),
                                                  ("linear", get_linear_schedule_with_warmup)])
def test_without_minutes_the_schedule_is_transformers_own(shape, reference):
    ours = budget_schedule(optimizer(), warmup_steps=7, max_steps=50, shape=shape, clock=TrainingClock(None))
    theirs = reference(optimizer(), 7, 50)
    assert rates(ours, 50) == pytest.approx(rates(theirs, 50), rel=1e-12, abs=1e-15)


class FakeTime:
    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(budget.time, "monotonic", lambda: self.now)

    def at_minute(self, start: float, minute: float) -> None:
        self.now = start + 60.0 * minute


def test_with_minutes_the_decay_follows_the_clock_from_the_warmups_end_to_zero(monkeypatch):
    fake = FakeTime(monkeypatch)
    clock = TrainingClock(10.0)
    scheduler = budget_schedule(optimizer(), warmup_steps=2, max_steps=10_000, shape="cosine", clock=clock)
    clock.start()
    start = fake.now
    minute_of_step = {1: 0.5, 2: 1.0, 3: 5.5, 4: 9.0, 5: 10.0}

    def tick(step: int) -> None:
        fake.at_minute(start, minute_of_step[step])
        clock.tick()

    lrs = rates(scheduler, 5, tick)
    assert lrs[:3] == [0.0, 0.5, 1.0]  # the warmup counts steps; it ended at minute 1
    assert clock.warmup_end == 1.0
    assert lrs[3] == pytest.approx(0.5)  # minute 5.5: half of the 9 minutes after the warmup, cos(pi / 2)
    assert lrs[4] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 8 / 9)).item()))
    assert lrs[5] == 0.0 and clock.spent


def test_steps_that_run_out_first_lead_the_decay(monkeypatch):
    fake = FakeTime(monkeypatch)
    clock = TrainingClock(600.0)  # ten hours: the 20 steps end long before
    clock.start()
    scheduler = budget_schedule(optimizer(), warmup_steps=0, max_steps=20, shape="linear", clock=clock)
    lrs = rates(scheduler, 20, lambda step: (fake.at_minute(fake.now, 0.01), clock.tick()))
    assert lrs == pytest.approx([1 - s / 20 for s in range(21)]) and not clock.spent


def test_a_resumed_clock_goes_on_from_the_minutes_its_checkpoint_used(monkeypatch):
    fake = FakeTime(monkeypatch)
    first = TrainingClock(10.0)
    first.start()
    fake.at_minute(fake.now, 4.0)
    first.tick()
    first.end_warmup()
    state = first.state()
    assert state == {"used": 4.0, "warmup_end": 4.0}

    second = TrainingClock(10.0)
    second.resume(**state)
    fake.at_minute(fake.now, 100.0)  # the time between the two processes does not count
    second.start()
    fake.at_minute(fake.now, 3.0)
    assert second.tick() == pytest.approx(7.0) and second.decay_progress() == pytest.approx(0.5)
    assert not second.spent


def test_every_process_takes_the_main_processs_reading(monkeypatch):
    fake = FakeTime(monkeypatch)
    clock = TrainingClock(5.0, sync=lambda minutes: 5.0)  # the main process has spent the budget
    clock.start()
    fake.at_minute(fake.now, 1.0)
    assert clock.tick() == 5.0 and clock.spent
    untimed = TrainingClock(None, sync=lambda minutes: pytest.fail("no time budget: no collective per step"))
    untimed.start()
    assert untimed.tick() == 0.0 and not untimed.spent


def test_the_runs_progress_is_its_steps_or_its_minutes_whichever_is_further(monkeypatch):
    """What a loss that follows the run's schedule reads (Domino's λ): the share of steps before a step, or of
    minutes where a time budget is further along; never past 1."""
    assert [TrainingClock(None).run_progress(s, 8) for s in (0, 2, 8, 9)] == [0.0, 0.25, 1.0, 1.0]
    fake = FakeTime(monkeypatch)
    clock = TrainingClock(10.0)
    clock.start()
    start = fake.now
    fake.at_minute(start, 6.0)
    clock.tick()
    assert clock.run_progress(2, 1000) == pytest.approx(0.6)  # the minutes lead
    assert clock.run_progress(900, 1000) == pytest.approx(0.9)  # the steps lead
    fake.at_minute(start, 12.0)
    clock.tick()
    assert clock.run_progress(2, 1000) == 1.0

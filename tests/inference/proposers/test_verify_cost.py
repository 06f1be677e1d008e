"""The cached verify-cost curve is this machine's today: one measured while something else ran (slower, or steeper)
is measured again when a quick check finds the machine faster, one older than `MAX_AGE_S` is measured again, and a
check on a machine busier than its cached curve keeps the curve. Measuring is a stand-in here, returning the curves
a quiet or a busy machine gives (the real measurement: test_node_budget.py)."""

from __future__ import annotations

import json
import time

import pytest

import specheads.inference.proposers.verify_cost as vc
from specheads.inference.proposers.verify_cost import VerifyCost, verify_cost
from tests.conftest import tiny_model

QUIET = VerifyCost(nodes=(1, 4, 16), seconds=(0.048, 0.128, 0.169))  # the idle curve
BUSY = VerifyCost(nodes=(1, 4, 16), seconds=(0.104, 0.448, 0.600))  # the same machine, another process running
STEEP = VerifyCost(nodes=(1, 4, 16), seconds=(0.048, 0.300, 0.400))  # a quiet step, a verify measured under load


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A target, a cache folder, and the machine's state: `state["now"]` is what measuring finds today."""
    state = {"now": QUIET, "full": 0, "quick": 0}

    def measure(model, sizes=vc.DEFAULT_SIZES, reps=3, context=128, batch=1):
        key = "quick" if tuple(sizes) == vc.CHECK_SIZES else "full"
        state[key] += 1
        return state["now"]

    monkeypatch.setattr(vc, "measure_verify_cost", measure)
    return tiny_model("llama"), tmp_path, state


def cache(tmp_path, model, cost, measured_at=None):
    path = tmp_path / f"{vc.machine_key(model)}.json"
    data = {"nodes": list(cost.nodes), "seconds": list(cost.seconds)}
    if measured_at is not None:
        data["measured_at"] = measured_at
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("cached", [BUSY, STEEP])
def test_a_curve_measured_on_a_busy_machine_is_measured_again(machine, cached, caplog):
    model, folder, state = machine
    path = cache(folder, model, cached, measured_at=time.time())
    with caplog.at_level("WARNING"):
        assert verify_cost(model, cache_dir=folder) == QUIET
    assert state == {"now": QUIET, "full": 1, "quick": 1}
    assert "measured while the machine was busy" in caplog.text
    saved = json.loads(path.read_text())
    assert tuple(saved["seconds"]) == QUIET.seconds and time.time() - saved["measured_at"] < 60


def test_a_busy_check_keeps_a_quiet_curve(machine):
    model, folder, state = machine
    cache(folder, model, QUIET, measured_at=time.time())
    state["now"] = BUSY  # something else runs during the check: the cached curve is the truer one
    assert verify_cost(model, cache_dir=folder) == QUIET
    assert (state["full"], state["quick"]) == (0, 1)


def test_an_old_curve_is_measured_again_and_an_undated_one_checked(machine):
    model, folder, state = machine
    cache(folder, model, QUIET, measured_at=time.time() - vc.MAX_AGE_S - 3600)
    assert verify_cost(model, cache_dir=folder) == QUIET
    assert (state["full"], state["quick"]) == (1, 0)
    cache(folder, model, QUIET)  # written before curves were dated: checked, and kept when it holds
    assert verify_cost(model, cache_dir=folder) == QUIET
    assert (state["full"], state["quick"]) == (1, 1)


def test_a_missing_or_damaged_entry_is_measured(machine):
    model, folder, state = machine
    assert verify_cost(model, cache_dir=folder) == QUIET and state["full"] == 1
    (folder / f"{vc.machine_key(model)}.json").write_text("{not json")
    assert verify_cost(model, cache_dir=folder) == QUIET and state["full"] == 2

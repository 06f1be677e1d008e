"""Adaptive speculation: the calibrated profile's arithmetic, the per-row rules, exactness whenever steps skip the
proposer (every drafter kind, n-gram lookup, a draft model), and `specheads calibrate` writing what serve reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specheads.inference.cli import main
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.speculation import AlwaysSpeculate, RowState
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from specheads.inference.proposers.verify_cost import machine_key
from specheads.inference.serve.adaptive import (
    AdaptiveSpeculation,
    BatchCost,
    SpeculationProfile,
    check_profile,
    read_profile,
    speculation_policy,
)
from specheads.inference.serve.calibrate import calibrate
from tests.conftest import perturbed_copy
from tests.drafters import DRAFTERS, proposer_for, save_case
from tests.inference.engine.test_engine_rows import MAX_NEW, PROMPTS, alone, decode_together


def cost(batch: int, plain: float, spec: float) -> BatchCost:
    return BatchCost(batch=batch, plain_step_s=plain, spec_step_s=spec)


# τ 1.7 beats the break-even at batch 1 (1.2) and 2 (1.5), not at 4 (2.5).
PROFILE = SpeculationProfile(method="ngram", machine_key="k", machine="test", tau=1.7,
                             accept_per_position=(0.6, 0.3, 0.1), mean_depth=3.0,
                             costs=(cost(1, 0.010, 0.012), cost(2, 0.012, 0.018), cost(4, 0.016, 0.040)))


def chain(depth: int) -> DraftTree:
    return DraftTree.chain(torch.arange(depth + 1))


def accepted(n: int) -> VerifyResult:
    return VerifyResult(path=torch.arange(n + 1), tokens=torch.arange(n + 1))


# --- the profile ---------------------------------------------------------------------------------------------------


def test_the_profile_interpolates_between_batch_sizes_and_knows_where_speculation_stops_paying():
    assert PROFILE.max_batch == 2
    assert PROFILE.break_even(1) == pytest.approx(1.2)
    assert PROFILE.break_even(3) == pytest.approx((1.5 + 2.5) / 2)  # halfway between batch 2 and 4
    assert PROFILE.break_even(64) == pytest.approx(2.5)  # beyond the largest: its value
    assert PROFILE.level_cost(1) == pytest.approx(0.2 / 3)  # (break-even - 1) / mean depth
    assert [PROFILE.pays(b) for b in (1, 2, 3, 4)] == [True, True, False, False]  # 3: break-even 2.0 > τ
    never = replace(PROFILE, costs=(cost(1, 0.01, 0.03),))
    assert never.max_batch == 0


def test_the_profile_round_trips_through_json_and_other_files_are_refused(tmp_path):
    path = tmp_path / "calibration.json"
    PROFILE.save(path)
    assert read_profile(path) == PROFILE
    (tmp_path / "bad.json").write_text(json.dumps({"method": "ngram"}))
    with pytest.raises(ValueError, match="is not a speculation profile.*specheads calibrate"):
        read_profile(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="does not exist; write it with `specheads calibrate"):
        read_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="increasing batch sizes"):
        replace(PROFILE, costs=PROFILE.costs[::-1])
    with pytest.raises(ValueError, match="tau >= 1"):
        replace(PROFILE, tau=0.5)
    with pytest.raises(ValueError, match="step times must be > 0"):
        replace(PROFILE, costs=(cost(1, 0.0, 0.01),))


def test_a_profile_for_another_method_or_machine_is_refused():
    check_profile(PROFILE, method="ngram", machine_key="k")
    with pytest.raises(ValueError, match="calibrated for method 'ngram', not 'eagle'.*specheads calibrate"):
        check_profile(PROFILE, method="eagle", machine_key="k")
    with pytest.raises(ValueError, match="another target, dtype, device.*calibrate` again"):
        check_profile(PROFILE, method="ngram", machine_key="other")


def test_modes_by_name():
    assert speculation_policy("on").depth(RowState(), 8) is None and speculation_policy("on").enabled(64)
    assert speculation_policy("off").depth(RowState(), 1) == 0 and not speculation_policy("off").enabled(1)
    assert isinstance(speculation_policy("adaptive", PROFILE), AdaptiveSpeculation)
    with pytest.raises(ValueError, match="needs a calibration.*specheads calibrate"):
        speculation_policy("adaptive")
    with pytest.raises(ValueError, match="unknown speculation mode 'fast'"):
        speculation_policy("fast")


# --- the rules -----------------------------------------------------------------------------------------------------


def test_rows_step_plainly_above_the_batch_threshold():
    policy, row = AdaptiveSpeculation(PROFILE), RowState()
    policy.start(row)
    assert policy.depth(row, 3) == 0 and policy.depth(row, 4) == 0
    assert policy.depth(row, 2) != 0 and policy.depth(row, 1) != 0
    assert [policy.enabled(b) for b in (1, 2, 3, 4)] == [True, True, False, False]  # spec_decode_enabled


def test_a_row_below_break_even_steps_plainly_then_probes_again():
    policy, row = AdaptiveSpeculation(PROFILE, probe_every=3), RowState()
    policy.start(row)
    assert row.tau == PROFILE.tau  # starts from the calibrated τ
    for _ in range(2):  # two rejected drafts: τ falls to 1.7*0.75^2 + 1 - 0.75^2 = 1.39, below the break-even 1.5
        assert policy.depth(row, 2) != 0
        policy.observe(row, 2, chain(3), accepted(0))
    assert row.tau < PROFILE.break_even(2)
    assert [policy.depth(row, 2) for _ in range(3)] == [0, 0, 0]  # probe_every plain steps
    assert policy.depth(row, 2) != 0  # then a probe
    policy.observe(row, 2, chain(3), accepted(3))  # a good probe lifts τ above break-even: the row drafts on
    assert row.tau > PROFILE.break_even(2) and policy.depth(row, 2) != 0
    before = row.tau
    policy.observe(row, 2, DraftTree.root_only(5), accepted(0))  # allowed to draft, the proposer found nothing:
    assert row.tau == pytest.approx(0.75 * before + 0.25)  # a step of τ 1 counts, as it does in the calibration
    before = row.tau
    assert policy.depth(row, 4) == 0  # above the batch threshold: a plain step the policy chose ...
    policy.observe(row, 4, DraftTree.root_only(5), accepted(0))
    assert row.tau == before  # ... says nothing about the drafter


def test_the_draft_depth_follows_the_observed_acceptance_per_position():
    policy, row = AdaptiveSpeculation(PROFILE, probe_every=1000), RowState()
    policy.start(row)
    # Calibrated shares 0.6, 0.3, 0.1 all beat the level cost at batch 1 (0.067): no cap.
    assert policy.depth(row, 1) is None
    # At batch 2 one level costs (1.5 - 1) / 3 = 0.167 plain steps: the third level (0.1) is not worth it.
    assert policy.depth(row, 2) == 2
    for _ in range(200):  # the drafts now never get past their first token
        policy.observe(row, 1, chain(3), accepted(1))
    assert policy.depth(row, 1) == 1
    policy = AdaptiveSpeculation(PROFILE, probe_every=2)
    policy.start(row)
    assert [policy.depth(row, 2) for _ in range(4)] == [2, None, 2, None]  # every 2nd capped step probes uncapped


# --- exactness -----------------------------------------------------------------------------------------------------


class Skipping(AlwaysSpeculate):
    """Rows take turns: plain steps, capped drafts and full drafts in a fixed per-row cycle, so every proposer sees
    steps it never drafted for, at any point of its state."""

    CYCLE = (None, 0, 1, 0, 0, None, 2, None)

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.choices: list[int | None] = []

    def depth(self, row: RowState, batch: int) -> int | None:
        i = self.counts[id(row)] = self.counts.get(id(row), id(row) % 5) + 1
        self.choices.append(self.CYCLE[i % len(self.CYCLE)])
        return self.choices[-1]


def _proposer(method: str, target, tmp_path):
    if method == "draft":
        return DraftModelProposer(perturbed_copy(target, 0.02))
    if method in ("ngram", "suffix"):
        return make_proposer(method, target, METHODS.get(method).make_options({}), None)
    save_case(method, target, tmp_path)
    return proposer_for(method, target, tmp_path, {})


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", *sorted(DRAFTERS)])
def test_rows_stay_exact_when_steps_skip_the_proposer(method, target, tmp_path):
    policy = Skipping()
    engine = Engine(target, _proposer(method, target, tmp_path), max_rows=3, speculation=policy)
    assert decode_together(engine) == alone(target)
    assert {None, 0, 1, 2} <= set(policy.choices)


def test_an_adaptive_engine_drafts_only_at_the_batch_sizes_that_pay(target):
    proposer = DraftModelProposer(perturbed_copy(target, 0.02))  # drafts every step, mostly accepted
    engine = Engine(target, proposer, max_rows=3, speculation=AdaptiveSpeculation(PROFILE))
    seqs = [engine.add(p, max_new_tokens=m) for p, m in zip(PROMPTS, MAX_NEW)]
    drafted_at: set[int] = set()
    while any(not s.done for s in seqs):
        verifying = engine.num_running  # the rows this step verifies (newcomers are only prefilled)
        engine.step()
        if engine.drafted_last_step:
            drafted_at.add(verifying)
    assert [s.output for s in seqs] == alone(target)
    assert drafted_at and max(drafted_at) <= PROFILE.max_batch


# --- calibrate ------------------------------------------------------------------------------------------------------


class _Record(AlwaysSpeculate):
    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []  # (accepted, tree depth) of each step, the prefill first

    def observe(self, row, batch, tree, result) -> None:
        self.steps.append((result.num_accepted, tree.max_depth))


def test_calibrate_times_each_batch_size_and_measures_acceptance_on_the_timed_steps(target):
    proposer = DraftModelProposer(perturbed_copy(target, 0.02))
    seen = []
    steps = 3
    profile = calibrate(target, proposer, PROMPTS[:3], method="draft", batch_sizes=(2, 1), steps=steps, rounds=2,
                        progress=seen.append)
    assert [c.batch for c in profile.costs] == [1, 2] and len(seen) == 2
    assert profile.machine_key == machine_key(target) and profile.method == "draft"
    assert all(c.plain_step_s > 0 and c.spec_step_s > 0 for c in profile.costs)
    # Batch 1 runs each of the 3 prompts, batch 2 runs rows (0, 1) and (2, 0); each row's timed steps are its steps
    # 3 .. steps + 2 (after the prefill and the first draft), which it drafts and accepts as it does alone.
    alone = {}
    for i in range(3):
        record = _Record()
        engine = Engine(target, DraftModelProposer(perturbed_copy(target, 0.02)), speculation=record)
        engine.add(PROMPTS[i], max_new_tokens=16 * (steps + 2))
        for _ in range(steps + 2):
            engine.step()
        engine.abort()
        alone[i] = record.steps[2:]
    timed = [step for i in (0, 1, 2, 0, 1, 2, 0) for step in alone[i]]
    assert profile.tau == pytest.approx(sum(a + 1 for a, _ in timed) / len(timed))
    assert profile.mean_depth == pytest.approx(sum(d for _, d in timed) / len(timed))
    assert profile.accept_per_position[0] == pytest.approx(sum(a > 0 for a, _ in timed) / len(timed), abs=1e-4)
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        calibrate(target, proposer, PROMPTS, method="ngram", batch_sizes=(0,))


def test_the_calibrate_command_writes_the_profile_serve_reads(tiny_model_dir, tmp_path, capsys):
    from specheads.target import load_target

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w5 w6 w{i} w5"]})
                                   for i in range(3)))
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--target", str(tiny_model_dir), "--method", "ngram", "--depth", "3", "--questions",
                 str(questions), "--batch-sizes", "1,2", "--steps", "2", "--rounds", "1", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "break-even" in printed and f"wrote {out}" in printed
    profile = read_profile(out)
    model, _ = load_target(str(tiny_model_dir), weight_layout="auto")  # as the command loads it
    check_profile(profile, method="ngram+depth=3", machine_key=machine_key(model))
    # serve refuses an adaptive mode without a calibration, and a calibration for another method, naming the fix
    assert main(["serve", "--target", str(tiny_model_dir), "--speculation", "adaptive"]) == 2
    assert "needs --calibration" in capsys.readouterr().err
    assert main(["serve", "--target", str(tiny_model_dir), "--method", "ngram", "--calibration", str(out)]) == 2
    assert "calibrated for method 'ngram+depth=3', not 'ngram'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--method", "ngram", "--questions", str(questions), "--batch-sizes", "1,x", "--output",
              str(out)])
    assert "expected comma-separated integers" in capsys.readouterr().err

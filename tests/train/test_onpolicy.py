"""The on-policy phase: rollout rows mark what they should, the settings refuse what cannot run, and a run rolls out
with the drafter it trains, replays the rows into its batches and resumes with the same buffer."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.inference.engine.rollout import DraftStep, Rollout
from specheads.inference.engine.stats import GenerationStats
from specheads.train.__main__ import main as train_main
from specheads.train.config import load_train_config
from specheads.train.onpolicy import OnPolicy, OnPolicyConfig, replay_row
from tests.conftest import base_args
from tests.train.test_recipe import metrics

OUT = Rollout(prompt=[1, 2, 3], output=[10, 11, 12, 13, 14, 15, 16],
              steps=[DraftStep(start=1, drafted=3, accepted=1, rejected=True),  # rejects output[2]
                     DraftStep(start=3, drafted=3, accepted=3, rejected=False),  # all accepted
                     DraftStep(start=7, drafted=2, accepted=0, rejected=True)],  # past the output's end: cut off
              stats=GenerationStats())


def test_a_rejected_steps_row_covers_its_block_through_the_rejection():
    row = replay_row(OUT, "rejected")
    assert row["input_ids"] == [1, 2, 3, 10, 11, 12, 13, 14, 15, 16]
    # the root output[0] (position 3), the accepted output[1] and the rejected output[2]; nothing else
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert replay_row(OUT, "all")["loss_mask"] == [0, 0, 0] + [1] * 7
    clean = Rollout([1, 2], [5, 6, 7], [DraftStep(1, 2, 2, False)], GenerationStats())
    assert replay_row(clean, "rejected") is None and OUT.failures() == [2]


def test_replay_appends_rows_with_their_features():
    data = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8]]
    masks = [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1]]
    policy = OnPolicy(OnPolicyConfig(every=1, replay_rows=3, max_new_tokens=4), data, masks, max_length=8, seed=0,
                      process=0, processes=1)
    assert sorted(map(tuple, policy.prompts)) == [(1, 2), (1, 2, 3)]
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]), "attention_mask": torch.ones(1, 5, dtype=torch.long),
             "loss_mask": torch.tensor([[0, 0, 1, 1, 1]])}
    assert policy.replay(batch, 1, 0, None, ()) == (batch, 0)  # nothing collected yet
    policy.collect([OUT], seconds=1.0)
    from tests.conftest import tiny_model

    target = tiny_model("llama")
    cached = dict(batch, features=torch.randn(1, 5, target.config.hidden_size))
    merged, added = policy.replay(cached, 1, 0, target, ())
    assert added == 3
    assert merged["input_ids"].shape == (4, 10) and merged["features"].shape == (4, 10, target.config.hidden_size)
    assert merged["loss_mask"][1:].tolist() == [replay_row(OUT, "rejected")["loss_mask"]] * 3
    assert torch.equal(merged["features"][0, :5], cached["features"][0]) and not merged["features"][0, 5:].any()
    assert torch.equal(merged["input_ids"][0, 5:], torch.zeros(5, dtype=torch.long))  # padded
    assert torch.equal(policy.replay(cached, 1, 0, target, ())[0]["input_ids"], merged["input_ids"])  # same draws


@pytest.mark.parametrize(("extra", "message"), [
    (("onpolicy.every=2", "onpolicy.train_on=worst"), "onpolicy.train_on must be one of rejected, all"),
    (("onpolicy.every=2", "optim.grad_accum=2"), "use optim.grad_accum=1"),
    (("onpolicy.every=2", "recipe=medusa"), "onpolicy.every applies to heads recipes whose drafter decodes"),
    (("onpolicy.every=2", "onpolicy.max_new_tokens=96"), r"must be below data.max_length \(96\)"),
    (("onpolicy.every=-1",), "onpolicy.every must be >= 0"),
    (("onpolicy.every=2", "onpolicy.dtype=fp8"), "onpolicy.dtype must be one of auto, target, bfloat16"),
])
def test_bad_onpolicy_settings_are_named(tiny_run_inputs, tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        load_train_config(None, base_args(tiny_run_inputs, tmp_path / "run", *extra))


def test_a_run_rolls_out_replays_and_resumes_with_its_buffer(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    args = base_args(tiny_run_inputs, out, "recipe=peagle", "heads.aux_layers=[1,2,3]", "features=offline",
                     "feature_dtype=float32", "max_steps=6", "save_every=4", "eval_every=100", "measure_prompts=0",
                     "onpolicy.every=2", "onpolicy.prompts=3", "onpolicy.rows=2", "onpolicy.max_new_tokens=24",
                     "onpolicy.train_on=all")
    assert train_main(args) == 0
    rows = metrics(out)
    rollouts = [r for r in rows if "rollout/tau" in r]
    assert [r["step"] for r in rollouts] == [2, 4]  # not at the last step: nothing would train on it
    assert all(1.0 <= r["rollout/tau"] <= 5.0 and r["rollout/tokens"] > 0 for r in rollouts)
    assert rollouts[-1]["replay/buffer_rows"] == 6  # three rows each
    assert (out / "onpolicy" / "heads-0" / "config.json").is_file()  # what it decoded from, as a user loads it
    saved = json.loads((out / "checkpoints" / "step_4" / "onpolicy-0.json").read_text())
    assert saved["rollouts"] == 2 and saved["cursor"] == 6 and len(saved["buffer"]) == 6
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) and any(r["loss_mask"]) for r in saved["buffer"])
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert [steps[s]["replay_rows"] for s in range(1, 7)] == [0, 0, 2, 2, 2, 2]  # from the first rollout on
    # resumed from step 4: the same buffer, so steps 5 and 6 train on the same batches and give the same losses
    for ckpt in ("step_6",):
        for path in (out / "checkpoints" / ckpt).iterdir():
            if path.is_file():
                path.unlink()
    assert train_main([*args, "resume=true"]) == 0
    again = {r["step"]: r for r in metrics(out) if "loss" in r}
    for step in (5, 6):
        assert again[step]["loss"] == pytest.approx(steps[step]["loss"], rel=1e-5), step


def test_rollouts_draft_chains(tiny_run_inputs, tmp_path):
    from specheads.inference.bench.runner import rollout_drafter
    from specheads.inference.engine.rollout import rollout
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.target import load_target

    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "recipe=peagle", "heads.aux_layers=[1,2,3]", "max_steps=2",
                                "measure_prompts=0")) == 0
    target, _ = load_target(str(tiny_run_inputs[0]))
    prompts = [[1, 5, 9, 12, 2, 1, 20, 23], [1, 7, 8, 30, 31, 2, 1]]
    chains = rollout_drafter(target, "peagle", str(out / "final"), prompts, max_new_tokens=16, rows=2)
    depth = json.loads((out / "final" / "config.json").read_text())["config"]["num_depths"]
    assert all(1 <= s.drafted <= depth for o in chains for s in o.steps)
    trees = rollout(target, make_proposer("peagle", target, METHODS.get("peagle").heads_alone(str(out / "final")),
                                          None), prompts, max_new_tokens=16, rows=2)
    assert max(s.drafted for o in trees for s in o.steps) > depth  # whole trees draft more: the check can fail
    assert [o.output for o in chains] == [o.output for o in trees]  # exact either way


def test_rollouts_decode_a_bf16_copy_of_the_target_where_asked(tiny_run_inputs, tmp_path, monkeypatch):
    from specheads.target import load_target

    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "recipe=peagle", "heads.aux_layers=[1,2,3]", "max_steps=2",
                                "measure_prompts=0")) == 0
    target, _ = load_target(str(tiny_run_inputs[0]))
    data, masks = [[1, 5, 9, 12, 2, 1, 20, 23, 4], [1, 7, 8, 30, 31, 2, 1, 6]], [[0] * 6 + [1] * 3, [0] * 7 + [1]]
    for native in (False, True):  # auto: bf16 only where the CPU has it
        monkeypatch.setattr("specheads.train.onpolicy.cpu_has_native_bf16", lambda native=native: native)
        auto = OnPolicyConfig(every=1).rollout_dtype(target)
        assert auto == (torch.bfloat16 if native else torch.float32)
        assert OnPolicyConfig(every=1, dtype="target").rollout_dtype(target) == torch.float32
    policy = OnPolicy(OnPolicyConfig(every=1, prompts=2, rows=2, max_new_tokens=8, dtype="bfloat16"), data, masks,
                      max_length=32, seed=0, process=0, processes=1)
    figures = policy.roll_out(target, str(tiny_run_inputs[0]), "peagle", out / "final", [])
    assert figures["rollout/tokens"] == 16 and 1.0 <= figures["rollout/tau"]
    decoder = policy.decoder
    assert decoder is not None and decoder.dtype == torch.bfloat16 and target.dtype == torch.float32
    embed = target.get_input_embeddings().weight
    assert torch.equal(decoder.get_input_embeddings().weight, embed.to(torch.bfloat16))  # the same target, in bf16
    policy.roll_out(target, str(tiny_run_inputs[0]), "peagle", out / "final", [])
    assert policy.decoder is decoder  # loaded once
    same = OnPolicy(OnPolicyConfig(every=1, max_new_tokens=8, dtype="target"), data, masks, max_length=32, seed=0,
                    process=0, processes=1)
    assert same.decoding_target(target, str(tiny_run_inputs[0])) is target and same.decoder is None

"""The distill recipe end to end on a tiny target: every divergence lowers its loss, final/ is a plain HF model
folder that decodes exactly as a draft model, and bad settings are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specheads.train.__main__ import main as train_main
from specheads.train.config import load_train_config
from tests.conftest import base_args
from tests.train.eval_rows import assert_class_top1_adds_up


def distill_args(inputs, out: Path, *extra: str) -> list[str]:
    return [a for a in base_args(inputs, out) if not a.startswith("recipe=")] + [
        "recipe=distill", "drafter.init=early-exit:1", "optim.lr=0.003", "max_steps=16", "eval_every=8",
        "save_every=16", *extra]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", "tv"])
def test_each_divergence_lowers_its_loss(tiny_run_inputs, tmp_path, divergence):
    out = tmp_path / divergence
    assert train_main(distill_args(tiny_run_inputs, out, f"drafter.divergence={divergence}",
                                   "measure_prompts=0")) == 0
    got = losses(out)
    assert sum(got[s] for s in (14, 15, 16)) < 0.9 * sum(got[s] for s in (1, 2, 3)), got  # tv falls slowest


def test_final_is_a_plain_model_folder_that_drafts_exactly(tiny_run_inputs, tmp_path):
    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import load_target

    out = tmp_path / "run"
    assert train_main(distill_args(tiny_run_inputs, out, "drafter.divergence=tv")) == 0
    final = out / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer_config.json").is_file()
    assert json.loads((final / "specheads_distill.json").read_text())["target"] == str(tiny_run_inputs[0])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tv" in r]
    assert [r["step"] for r in evals] == [8, 16] and all(0 <= r["eval/top1_step1"] <= 1 for r in evals)
    assert_class_top1_adds_up(evals[-1], "eval/top1_step1")
    assert rows[-1]["eval/measured_prompts"] == 4 and rows[-1]["eval/measured_tau"] >= 1.0
    saved = yaml_section(out)
    assert saved["drafter"]["divergence"] == "tv" and "heads" not in saved  # config.yaml loads back as written
    assert load_train_config(out / "config.yaml", []).heads.divergence == "tv"

    target, _ = load_target(str(tiny_run_inputs[0]))
    draft = AutoModelForCausalLM.from_pretrained(final)  # loads with transformers alone
    assert draft.config.num_hidden_layers == 1
    trained, start = draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(trained, start)  # it trained its own copy; the target is untouched
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    proposer = make_proposer("draft", target, METHODS.get("draft").make_options({"draft": str(final)}),
                             lambda path: load_target(path)[0])
    res = Engine(target, proposer).generate(prompt, max_new_tokens=24)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0


@pytest.mark.parametrize("parallel_k", [1, 3], ids=["chain", "parallel"])
def test_lora_trains_adapters_only_and_final_holds_them_merged(tiny_run_inputs, tmp_path, parallel_k):
    from specheads.target import load_target
    from specheads.train.distill import DistillSettings, Drafter, LoraSettings, build_drafter, save_distilled

    target, tokenizer = load_target(str(tiny_run_inputs[0]))
    drafter = build_drafter(DistillSettings(init="early-exit:1", parallel_k=parallel_k,
                                            lora=LoraSettings(r=4, target_modules=("q_proj", "up_proj"))), target)
    trainable = [n for n, p in drafter.named_parameters() if p.requires_grad]
    # A parallel drafter also trains its placeholder's embedding row (and only that row), which starts untrained.
    assert trainable and all("lora_" in n or (parallel_k > 1 and "trainable_tokens" in n) for n in trainable)
    assert (parallel_k > 1) == any("trainable_tokens" in n for n in trainable)
    with torch.no_grad():  # adapters start as a no-op (B = 0): give them an update to merge
        for n, p in drafter.named_parameters():
            if "lora_B" in n or "trainable_tokens_delta" in n:
                p.normal_(std=0.2)
    ids = torch.tensor([[1, 5, 9, 12, 2, 1, 20, 23, 96, 96]])[:, : 8 + 2 * (parallel_k > 1)]  # 96: the placeholder
    keep = torch.ones_like(ids, dtype=torch.bool)
    drafter.eval()
    with torch.no_grad():
        unmerged = drafter(ids, torch.ones_like(ids), keep)
    save_distilled(drafter, tmp_path / "final", target=target, tokenizer=tokenizer, target_name="tiny", config=None,
                   metadata={})
    assert not (tmp_path / "final" / "adapter_config.json").exists()
    merged = Drafter(AutoModelForCausalLM.from_pretrained(tmp_path / "final"), vocab=96).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids, torch.ones_like(ids), keep), unmerged, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] are not linear layers of the drafter; its linear "
                                         r"layers are: down_proj, gate_proj, k_proj, lm_head"):
        build_drafter(DistillSettings(init="early-exit:1", lora=LoraSettings(target_modules=("qkv",))), target)


def test_a_lora_run_trains_and_saves_a_plain_model(tiny_run_inputs, tmp_path):
    out = tmp_path / "lora"
    assert train_main(distill_args(tiny_run_inputs, out, "drafter.lora.r=4", "measure_prompts=0")) == 0
    assert load_train_config(out / "config.yaml", []).heads.lora.r == 4
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 1


def yaml_section(out: Path) -> dict:
    import yaml

    return yaml.safe_load((out / "config.yaml").read_text())


@pytest.mark.parametrize(("extra", "message"), [
    (["drafter.divergence=kl"], "drafter.divergence 'kl' is unknown; use one of: forward_kl, reverse_kl, jsd, tv"),
    (["drafter.init=early-exit:x"], "N must be a layer count"),
    (["heads.num_layers=1"], "takes its settings under 'drafter:', not 'heads:'"),
    (["init_heads=runs/x/final"], "init_heads applies to heads recipes; the distill recipe starts from its "
                                  "drafter.init"),
    (["drafter.beta=1.5"], r"beta must be in \(0, 1\)"),
    (["drafter.parallel_k=0"], r"drafter.parallel_k must be >= 1 \(1: an ordinary drafter\), got 0"),
    (["drafter.parallel_k=96"], r"drafter.parallel_k=96 does not fit the training context \(data.max_length=96\)"),
    (["drafter.on_policy_fraction=1.5"], r"drafter.on_policy_fraction must be in \[0, 1\]"),
    (["drafter.on_policy_fraction=0.5", "features=offline"], "on_policy_fraction needs features: online"),
    (["drafter.cod_keep_rate=0"], r"drafter.cod_keep_rate must be in \(0, 1\]"),
])
def test_bad_settings_fail_with_one_line(tiny_run_inputs, tmp_path, capsys, extra, message):
    assert train_main(distill_args(tiny_run_inputs, tmp_path / "bad", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err or __import__("re").search(message, err), err
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_a_parallel_run_saves_a_parallel_drafter_that_decodes_exactly(tiny_run_inputs, tmp_path):
    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.inference.proposers.parallel_draft import ParallelDraftProposer
    from specheads.target import load_target

    out = tmp_path / "parallel"
    assert train_main(distill_args(tiny_run_inputs, out, "drafter.parallel_k=3", "eval_every=16",
                                   "measure_prompts=2")) == 0
    got = losses(out)
    assert sum(got[s] for s in (14, 15, 16)) < 0.9 * sum(got[s] for s in (1, 2, 3)), got
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["specheads_parallel"] == {"k": 3, "mask_token_id": 96} and config["vocab_size"] == 97
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tv" in r]
    assert all(0 <= evals[-1][f"eval/top1_step{j}"] <= 1 for j in (1, 2, 3)) and "eval/top1_step4" not in evals[-1]
    assert_class_top1_adds_up(evals[-1], "eval/top1_step1")
    assert "eval/top1_word_step3" in evals[-1] and "eval/top1_word_step4" not in evals[-1]  # each placeholder's
    assert rows[-1]["eval/measured_prompts"] == 2  # decoded through the parallel proposer

    target, _ = load_target(str(tiny_run_inputs[0]))
    proposer = make_proposer("draft", target, METHODS.get("draft").make_options({"draft": str(final)}),
                             lambda path: load_target(path)[0])
    assert isinstance(proposer, ParallelDraftProposer) and proposer.depth == 3
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    res = Engine(target, proposer).generate(prompt, max_new_tokens=24)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0


def test_on_policy_batches_are_the_drafters_own_continuations(tiny_run_inputs, tmp_path):
    from specheads.target import load_target
    from specheads.train.distill import DistillSettings, build_drafter, on_policy_batch

    target, _ = load_target(str(tiny_run_inputs[0]))
    drafter = build_drafter(DistillSettings(init="early-exit:1", parallel_k=2), target)
    ids = torch.tensor([[1, 5, 9, 12, 20, 23, 26, 0], [1, 7, 8, 30, 31, 0, 0, 0]])
    attention = torch.tensor([[1] * 7 + [0], [1] * 5 + [0] * 3])
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]])  # row 1: no assistant token
    torch.manual_seed(0)
    new = on_policy_batch(drafter, {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}, 6)
    n = int(new["attention_mask"][0].sum())
    assert 4 <= n <= 9 and torch.equal(new["input_ids"][0, :3], ids[0, :3])  # the prompt, then up to 6 sampled tokens
    assert new["loss_mask"][0, :n].tolist() == [0, 0, 0] + [1] * (n - 3)
    assert (new["input_ids"][0, :n] != 96).all()  # the placeholder is never sampled
    assert torch.equal(new["input_ids"][1, :5], ids[1, :5]) and new["loss_mask"][1].sum() == 0  # kept as it was
    assert drafter.training  # back in training mode

    out = tmp_path / "on-policy"
    assert train_main(distill_args(tiny_run_inputs, out, "drafter.on_policy_fraction=1",
                                   "drafter.on_policy_max_new_tokens=8",
                                   "max_steps=3", "eval_every=3", "save_every=3", "measure_prompts=0")) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["on_policy"] for r in steps if "loss" in r] == [1.0, 1.0, 1.0]

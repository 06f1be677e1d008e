"""The medusa2 recipe on a tiny target: heads and LoRA adapters trained jointly in two stages, final/ with the heads
and the adapter, exact decoding against the frozen target and (with --adapter) against the adapted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.inference.cli import main as cli_main
from specheads.train.__main__ import main as train_main
from tests.conftest import base_args, tiny_model
from tests.train.eval_rows import assert_class_top1_adds_up

PROMPT = "w5 w6 w7 w8 w9"
MEDUSA2 = ("recipe=medusa2", "heads.num_heads=2", "heads.lora.r=4", "heads.heads_lr_multiplier=2.0")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tiny_run_inputs, tmp_path_factory) -> Path:
    """One short run shared by the tests below: 6 heads-only steps, then 14 joint ones."""
    out = tmp_path_factory.mktemp("medusa2") / "run"
    assert train_main(base_args(tiny_run_inputs, out, *MEDUSA2, "heads.heads_only_steps=6", "max_steps=20",
                                "save_every=6", "eval_every=20", "optim.lr=0.01", "measure_prompts=2",
                                "measure_max_new_tokens=16")) == 0
    return out


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (2, 24), generator=g)
    loss = torch.zeros_like(ids)
    loss[:, 10:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss}


def _adapters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if "lora_" in n}


def test_stage_one_moves_the_heads_only_and_the_joint_stage_the_adapters_too():
    from specheads.train.lora import LoraSettings
    from specheads.train.medusa2 import (
        Medusa2Settings,
        build_medusa2,
        medusa2_param_groups,
        medusa2_step_loss,
    )

    torch.manual_seed(0)
    settings = Medusa2Settings(num_heads=2, lora=LoraSettings(r=4), heads_only_steps=3, heads_lr_multiplier=5.0)
    module = build_medusa2(settings, tiny_model("llama"))
    groups = medusa2_param_groups(module, 0.01, settings)
    assert [g["lr"] for g in groups] == [0.05, 0.01]  # the heads at lr x heads_lr_multiplier, the adapters at lr
    assert "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in module.heads.parameters() if p.requires_grad}
    assert all(any(id(p) == id(q) for g in groups[1:] for q in g["params"]) for n, p in module.named_parameters()
               if "lora_" in n)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("heads.blocks") for n in trainable), trainable
    optimizer = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)  # the adapters' group has none
    start, heads_start = _adapters(module), module.heads.blocks[0][0].linear.weight.detach().clone()
    stats = []
    for step in range(6):
        loss, row = medusa2_step_loss(module, module.model.get_base_model(), _batch(step), settings)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats.append(row)
        if step == 2:  # the end of stage 1: the heads moved, the adapters did not
            assert all(torch.equal(start[n], p) for n, p in _adapters(module).items())
            assert not torch.equal(heads_start, module.heads.blocks[0][0].linear.weight)
            assert stats[-1]["self_distill_kl"] == 0.0  # the adapters are still the identity (lora_B = 0)
    assert [r["joint"] for r in stats] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    moved = [n for n, p in _adapters(module).items() if not torch.equal(start[n], p)]
    assert any("lora_B" in n for n in moved), moved
    assert stats[-1]["self_distill_kl"] > 0.0  # the adapted target now differs from the frozen one
    assert int(module.steps_done) == 6


def test_bad_settings_give_one_clear_error(tiny_run_inputs, tmp_path, capsys):
    from specheads.train.lora import LoraSettings
    from specheads.train.medusa2 import Medusa2Settings, build_medusa2

    code = train_main(base_args(tiny_run_inputs, tmp_path / "off", *MEDUSA2, "features=offline"))
    err = capsys.readouterr().err
    assert code == 2 and "medusa2 recipe needs features: online" in err and "set features: online" in err
    code = train_main(base_args(tiny_run_inputs, tmp_path / "few", *MEDUSA2, "max_steps=5", "heads.heads_only_steps=5"))
    assert code == 2 and "leaves no joint step" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"heads.lora.target_modules \['qkv'\] are not linear layers of the target; "
                                         r"its linear layers are: down_proj, gate_proj, k_proj, lm_head"):
        build_medusa2(Medusa2Settings(lora=LoraSettings(target_modules=("qkv",))), tiny_model("llama"))
    with pytest.raises(ValueError, match=r"names the LM head \(lm_head\)"):
        build_medusa2(Medusa2Settings(lora=LoraSettings(target_modules=("q_proj", "lm_head"))), tiny_model("llama"))


def test_the_recipe_trains_in_two_stages_and_saves_heads_and_adapter(run):
    from safetensors.torch import load_file

    rows = metrics(run)
    losses = {r["step"]: r for r in rows if "loss" in r}
    assert [losses[s]["joint"] for s in (1, 6, 7, 20)] == [0.0, 0.0, 1.0, 1.0]
    assert sum(losses[s]["loss"] for s in (18, 19, 20)) < 0.9 * sum(losses[s]["loss"] for s in (1, 2, 3)), losses
    assert losses[6]["self_distill_kl"] == 0.0 and losses[20]["self_distill_kl"] > 0.0  # logged every step
    assert max(r["lr"] for r in losses.values()) > 0.01  # the first group is the heads', at lr x 2
    evaluation = next(r for r in rows if "eval/self_distill_kl" in r)
    assert "eval/simulated_tau_chain" in evaluation and "eval/frozen_simulated_tau_chain" in evaluation
    assert_class_top1_adds_up(evaluation, "eval/top1_head0")  # the heads on the adapted features
    assert 1.0 <= rows[-1]["eval/measured_tau"] and rows[-1]["eval/measured_prompts"] == 2
    final = run / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["config"]["tree"], cfg
    assert {"adapter_config.json", "adapter_model.safetensors", "specheads_target.json"} <= {
        p.name for p in (final / "adapter").iterdir()}
    # The checkpoint after stage 1 holds the adapters as initialised (lora_B is zero); final/ has them trained.
    stage1 = load_file(run / "checkpoints" / "step_6" / "model.safetensors")
    assert all(not t.any() for n, t in stage1.items() if "lora_B" in n) and any("lora_B" in n for n in stage1)
    # Checkpoints hold what trains (and the stage), not the frozen target.
    assert all("lora_" in n or n.startswith("heads.blocks.") or n == "steps_done" for n in stage1), sorted(stage1)
    trained = load_file(final / "adapter" / "adapter_model.safetensors")
    assert any(t.any() for n, t in trained.items() if "lora_B" in n)


def _plain_greedy(model, tokenizer, max_new_tokens: int) -> list[int]:
    from specheads.inference import Engine
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import render_chat

    return Engine(model, AutoregressiveProposer()).generate(render_chat(tokenizer, [PROMPT]),
                                                            max_new_tokens=max_new_tokens).output_ids


def _cli_ids(capsys, tmp_path: Path, *args: str) -> list[int]:
    out = tmp_path / "out.jsonl"
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": [PROMPT]}) + "\n")
    code = cli_main(["generate", *args, "--questions", str(questions), "--max-new-tokens", "24",
                     "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    return json.loads(out.read_text().splitlines()[0])["output_ids"]


def test_decoding_is_exact_against_the_frozen_and_the_adapted_target(run, tiny_run_inputs, tmp_path, capsys):
    from peft import PeftModel

    from specheads.target import load_target

    target_dir, adapter = str(tiny_run_inputs[0]), str(run / "final" / "adapter")
    heads = ("--method", "medusa", "--heads", str(run / "final"))
    frozen, tokenizer = load_target(target_dir)
    assert _cli_ids(capsys, tmp_path, "--target", target_dir, *heads) == _plain_greedy(frozen, tokenizer, 24)

    peft_model = PeftModel.from_pretrained(load_target(target_dir)[0], adapter)
    merged = load_target(target_dir, adapter=adapter)[0]
    ids = torch.tensor([[1, 5, 9, 12, 2, 1, 20, 23, 26, 29]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, frozen(ids).logits)  # the adapter changes the target
    assert _cli_ids(capsys, tmp_path, "--target", target_dir, *heads, "--adapter", adapter) == _plain_greedy(
        merged, tokenizer, 24)


def test_an_adapter_that_is_missing_or_does_not_fit_is_refused(run, tiny_run_inputs, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    foreign = tmp_path / "foreign"  # peft's own folder, for a target of another width (no specheads_target.json)
    get_peft_model(tiny_model("llama", hidden=32), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(foreign)
    other = tmp_path / "other"  # ours, trained on a target with 2 layers
    other.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (other / name).write_bytes((run / "final" / "adapter" / name).read_bytes())
    info = json.loads((run / "final" / "adapter" / "specheads_target.json").read_text())
    (other / "specheads_target.json").write_text(json.dumps(info | {"num_layers": 2}))
    cases = [(tmp_path / "none", "does not exist; pass a medusa2 run's final/adapter folder"),
             (run / "final", "has no adapter_config.json"),
             (foreign, "does not fit this target"),
             (other, "was trained for target")]
    for folder, message in cases:
        code = cli_main(["generate", "--target", str(tiny_run_inputs[0]), "--adapter", str(folder), "--prompt", "w5",
                         "--max-new-tokens", "2"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()  # the model's loading progress may come first
        assert code == 2 and message in lines[-1] and err.count("error:") == 1, (folder, err)


def test_resume_after_stage_one_continues_with_the_same_losses(run, tiny_run_inputs, tmp_path):
    import shutil

    part = tmp_path / "part"  # a run that stopped after its step-6 checkpoint, the last of stage 1
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_6", part / "checkpoints" / "step_6")
    shutil.copy(run / "config.yaml", part / "config.yaml")
    assert train_main(base_args(tiny_run_inputs, part, *MEDUSA2, "heads.heads_only_steps=6", "max_steps=20",
                                "save_every=6", "eval_every=20", "optim.lr=0.01", "measure_prompts=0",
                                "resume=true")) == 0
    a = {r["step"]: r for r in metrics(run) if "loss" in r}
    b = {r["step"]: r for r in metrics(part) if "loss" in r}
    assert b[7]["joint"] == 1.0  # the stage was restored with the checkpoint
    for step in range(7, 21):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-6), step


@pytest.mark.slow  # two launched processes: ~50 s on 2 busy cores
def test_two_ddp_processes_train_medusa2_as_one(tiny_run_inputs, tmp_path):
    """Both stages under DDP (every parameter gets a gradient in each): 2 processes x batch 2 end where 1 x 4 does."""
    from safetensors.torch import load_file

    from tests.train.test_scale_out import CONFIGS, RUN, launch, train_losses

    # The whole vocabulary: with a draft vocabulary, conversations differ in how many labels the heads can score, and
    # the mean of two shard means is no longer the batch mean (see test_scale_out's module docstring).
    stages = (*MEDUSA2, "heads.heads_only_steps=2", "draft_vocab_size=null")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_main(base_args(tiny_run_inputs, one, *RUN, *stages, "optim.batch_size=4")) == 0
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2,
                  ["-m", "specheads.train", *base_args(tiny_run_inputs, two, *RUN, *stages, "optim.batch_size=2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(one / "final" / file), load_file(two / "final" / file)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert train_losses(two) == pytest.approx(train_losses(one), rel=1e-5)

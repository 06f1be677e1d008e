"""The training recipe end to end on a tiny target: loss goes down, checkpoints resume exactly,
W&B offline writes the run, and the heads decode exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.train.__main__ import main as train_main
from specheads.train.config import load_train_config
from tests.conftest import base_args
from tests.train.eval_rows import assert_class_top1_adds_up

REPO = Path(__file__).resolve().parents[2]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}


@pytest.mark.parametrize("heads", [(), ("heads.aux_layers=[1,2]", "features=offline", "feature_dtype=float32")],
                         ids=["eagle1", "aux-layers-offline"])
def test_eagle_recipe_lowers_the_loss_and_decodes_exactly(tiny_run_inputs, tmp_path, heads):
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "max_steps=24", "save_every=24", "eval_every=12",
                                "optim.lr=0.01", *heads)) == 0
    losses = train_losses(out)
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (22, 23, 24)) / 3
    assert last < 0.85 * first, losses
    evals = [r for r in metrics(out) if "eval/top1_step1" in r]
    assert [r["step"] for r in evals] == [12, 24] and "eval/simulated_tau_chain" in evals[-1]
    assert_class_top1_adds_up(evals[-1], "eval/top1_step1")
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["kind"] == "eagle" and len(cfg["config"]["draft_vocab"]) == 48
    assert cfg["config"]["aux_layers"] == ([1, 2] if heads else [])
    assert (out / "config.yaml").is_file()
    measured = metrics(out)[-1]  # the saved heads decoding held-out prompts through the bench's runner
    assert measured["eval/measured_prompts"] == 4  # the default, all from held-out conversations
    assert 1.0 <= measured["eval/measured_tau"] <= 6.0  # the bonus token plus at most the tree depth (5)
    # the same prompts drafting a chain of 3: τ is one plus the accepted run, which the first guess starts
    chain_tau, first = measured["eval/measured_chain_tau"], measured["eval/measured_chain_first_accept"]
    assert 1.0 <= chain_tau <= 4.0 and 0.0 <= first <= 1.0 and (chain_tau > 1.0) == (first > 0.0)

    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import load_target

    target, _ = load_target(str(tiny_run_inputs[0]))
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    drafted_per_step = {}
    for tree in (None, "wide", "eagle2"):  # every named tree decodes exactly; bigger ones draft more per step
        for budget in ("auto", "fixed"):  # auto prunes by this machine's verify cost, so only fixed sizes compare
            eagle = Engine(target, make_proposer("eagle", target, METHODS.get("eagle").make_options(
                {"heads": str(out / "final"), "tree": tree, "node_budget": budget, "lookup": 0}), None))
            res = eagle.generate(prompt, max_new_tokens=32)
            assert res.output_ids == plain.output_ids, (tree, budget)
        drafted_per_step[tree] = res.stats.drafted / res.stats.steps
    assert 0 < drafted_per_step[None] < drafted_per_step["wide"] < drafted_per_step["eagle2"], drafted_per_step


def test_eagle3_recipe_lowers_the_loss_decodes_exactly_and_keeps_its_draft_vocabulary(tiny_run_inputs, tmp_path):
    e3 = ("recipe=eagle3", "heads.aux_layers=[1,2,3]", "draft_vocab_size=40")
    out = tmp_path / "e3"
    assert train_main(base_args(tiny_run_inputs, out, *e3, "max_steps=24", "save_every=24", "eval_every=12",
                                "optim.lr=0.01")) == 0
    losses = train_losses(out)
    assert sum(losses[s] for s in (22, 23, 24)) < 0.85 * sum(losses[s] for s in (1, 2, 3)), losses
    cfg = json.loads((out / "final" / "config.json").read_text())
    vocab = cfg["config"]["draft_vocab"]
    assert cfg["kind"] == "eagle3" and len(vocab) == 40 and cfg["config"]["aux_layers"] == [1, 2, 3]
    assert json.loads((out / "draft_vocab.json").read_text())["draft_vocab"] == vocab

    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import load_target

    target, _ = load_target(str(tiny_run_inputs[0]))
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    heads = Engine(target, make_proposer("eagle3", target, METHODS.get("eagle3").make_options(
        {"heads": str(out / "final"), "lookup": 0}), None)).generate(prompt, max_new_tokens=32)
    assert heads.output_ids == plain.output_ids and heads.stats.drafted > 0

    # On other conversations a fresh run picks another draft vocabulary; a fine-tune keeps its heads' own
    # (their LM head rows are tied to it), and a resume keeps the one its run started with.
    other = ("data.skip_conversations=24", "max_steps=1", "save_every=1")
    assert train_main(base_args(tiny_run_inputs, tmp_path / "fresh", *e3, *other)) == 0
    fresh = json.loads((tmp_path / "fresh" / "draft_vocab.json").read_text())["draft_vocab"]
    assert fresh != vocab
    assert train_main(base_args(tiny_run_inputs, tmp_path / "ft", *e3, *other, f"init_heads={out / 'final'}")) == 0
    assert json.loads((tmp_path / "ft" / "final" / "config.json").read_text())["config"]["draft_vocab"] == vocab
    (tmp_path / "fresh" / "draft_vocab.json").write_text(json.dumps({"draft_vocab": vocab}))
    assert train_main(base_args(tiny_run_inputs, tmp_path / "fresh", *e3, "data.skip_conversations=24",
                                "max_steps=2", "save_every=1", "resume=true")) == 0
    assert json.loads((tmp_path / "fresh" / "final" / "config.json").read_text())["config"]["draft_vocab"] == vocab


def train_block_drafter(tiny_run_inputs, out: Path, kind: str, *settings: str) -> list[dict]:
    """A tiny run of a block drafter's recipe: the loss falls, evaluation reports a chain τ, and the final drafter
    decodes exactly; returns the run's metrics rows."""
    assert train_main(base_args(tiny_run_inputs, out, f"recipe={kind}", "heads.aux_layers=[1,2,3]", *settings,
                                "draft_vocab_size=40", "max_steps=24", "save_every=24", "eval_every=12",
                                "optim.lr=0.01")) == 0
    losses = train_losses(out)
    assert sum(losses[s] for s in (22, 23, 24)) < 0.85 * sum(losses[s] for s in (1, 2, 3)), losses
    rows = metrics(out)
    evals = [r for r in rows if "eval/top1_step3" in r]
    assert evals and 1.0 <= evals[-1]["eval/simulated_tau_chain"] <= 4.0
    assert_class_top1_adds_up(evals[-1], "eval/top1_step1")
    assert json.loads((out / "final" / "config.json").read_text())["kind"] == kind

    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import load_target

    target, _ = load_target(str(tiny_run_inputs[0]))
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    heads = Engine(target, make_proposer(kind, target, METHODS.get(kind).make_options(
        {"heads": str(out / "final"), "lookup": 0}), None)).generate(prompt, max_new_tokens=32)
    assert heads.output_ids == plain.output_ids and heads.stats.drafted > 0
    return rows


def test_peagle_recipe_lowers_the_loss_reports_every_depth_and_decodes_exactly(tiny_run_inputs, tmp_path):
    rows = train_block_drafter(tiny_run_inputs, tmp_path / "pe", "peagle", "heads.num_depths=3", "heads.ar_steps=2")
    assert any("top1_depth2" in r for r in rows)  # the deepest position trains
    assert any("top1_ar2" in r for r in rows)  # and the chain mode's unrolled step, reported with its chain τ
    assert 1.0 <= [r for r in rows if "eval/simulated_tau_ar_chain" in r][-1]["eval/simulated_tau_ar_chain"] <= 4.0


def test_dflash_recipe_lowers_the_loss_reports_every_slot_and_decodes_exactly(tiny_run_inputs, tmp_path):
    rows = train_block_drafter(tiny_run_inputs, tmp_path / "df", "dflash", "heads.block_size=4", "heads.max_anchors=8")
    assert any("top1_pos3" in r for r in rows)  # the last slot trains


def test_medusa_recipe_lowers_the_loss_and_stores_a_measured_tree(tiny_run_inputs, tmp_path):
    out = tmp_path / "medusa"
    assert train_main(base_args(tiny_run_inputs, out, "recipe=medusa", "heads.num_heads=2", "max_steps=20",
                                "save_every=20", "optim.lr=0.02")) == 0
    losses = train_losses(out)
    assert sum(losses[s] for s in (18, 19, 20)) < 0.9 * sum(losses[s] for s in (1, 2, 3)), losses
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["config"]["tree"], cfg
    assert_class_top1_adds_up(next(r for r in metrics(out) if "eval/top1_head0" in r), "eval/top1_head0")

    from specheads.inference import Engine
    from specheads.inference.methods import METHODS, make_proposer
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import load_target

    target, _ = load_target(str(tiny_run_inputs[0]))
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    medusa = Engine(target, make_proposer("medusa", target, METHODS.get("medusa").make_options(
        {"heads": str(out / "final")}), None))
    res = medusa.generate(prompt, max_new_tokens=32)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_with_the_same_losses(tiny_run_inputs, tmp_path, optimizer):
    import shutil

    full, part = tmp_path / "full", tmp_path / "part"
    run = ("max_steps=14", "save_every=7", f"optim.optimizer={optimizer}")
    assert train_main(base_args(tiny_run_inputs, full, *run)) == 0
    # A run that crashed after its step-7 checkpoint: its folder holds the config and that checkpoint only.
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_7", part / "checkpoints" / "step_7")
    shutil.copy(full / "config.yaml", part / "config.yaml")
    assert train_main(base_args(tiny_run_inputs, part, *run, "resume=true")) == 0
    a, b = train_losses(full), train_losses(part)
    for step in range(8, 15):  # steps 8.. cross an epoch boundary (11 batches per epoch)
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step


def test_offline_features_train_like_online(tiny_run_inputs, tmp_path):
    online, offline = tmp_path / "online", tmp_path / "offline"
    assert train_main(base_args(tiny_run_inputs, online, "max_steps=6", "save_every=6")) == 0
    assert train_main(base_args(tiny_run_inputs, offline, "max_steps=6", "save_every=6", "features=offline",
                                "feature_dtype=float32")) == 0
    assert (offline / "features" / "train" / "index.json").is_file()
    a, b = train_losses(online), train_losses(offline)
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4), step


def test_a_run_repeated_with_its_seed_writes_the_same_drafter(tiny_run_inputs, tmp_path):
    """The main job's claim that a second run reproduces the first (scripts/lab/compare_runs.py): the same settings and
    seed give byte-identical drafter files and the same losses, with offline features and bf16 autocast as there;
    another seed gives other weights, so the comparison can tell."""
    settings = ("recipe=peagle", "heads.aux_layers=[1,2,3]", "heads.num_depths=3", "features=offline",
                "mixed_precision=bf16", "max_steps=5", "save_every=5", "eval_every=5")
    runs = {name: tmp_path / name for name in ("a", "b", "other_seed")}
    for name, out in runs.items():
        assert train_main(base_args(tiny_run_inputs, out, *settings, f"seed={1 if name == 'other_seed' else 0}")) == 0

    def files(out: Path) -> dict[str, bytes]:
        return {str(f.relative_to(out)): f.read_bytes() for f in sorted((out / "final").rglob("*")) if f.is_file()}

    first = files(runs["a"])
    assert any(name.endswith(".safetensors") for name in first)
    assert files(runs["b"]) == first
    assert train_losses(runs["b"]) == train_losses(runs["a"])
    weights = [n for n in first if n.endswith(".safetensors")]
    assert all(files(runs["other_seed"])[n] != first[n] for n in weights)


def test_resume_with_a_changed_model_config_is_refused(tiny_run_inputs, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "max_steps=2", "save_every=2")) == 0
    code = train_main(base_args(tiny_run_inputs, out, "max_steps=4", "resume=true", "heads.num_layers=2"))
    assert code == 2 and "'heads' differs" in capsys.readouterr().err
    code = train_main(base_args(tiny_run_inputs, out, "max_steps=4", "resume=true", "optim.optimizer=muon"))
    assert code == 2 and "optim.optimizer differs" in capsys.readouterr().err


def test_init_heads_starts_from_saved_heads_and_refuses_ones_that_do_not_fit(tiny_run_inputs, tmp_path, capsys):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert train_main(base_args(tiny_run_inputs, first, "max_steps=12", "save_every=12", "optim.lr=0.01")) == 0
    # A near-zero learning rate: the continued run's heads stay what it loaded.
    cont = tmp_path / "cont"
    assert train_main(base_args(tiny_run_inputs, cont, "max_steps=1", "save_every=1", "optim.lr=1e-12",
                                f"init_heads={first / 'final'}")) == 0
    saved, continued = load_file(first / "final" / "model.safetensors"), load_file(cont / "final" / "model.safetensors")
    assert saved.keys() == continued.keys()
    for key in saved:
        torch.testing.assert_close(continued[key], saved[key], rtol=0, atol=1e-9)
    assert train_losses(cont)[1] < 0.9 * train_losses(first)[1]  # it starts where the first run ended, not from scratch

    assert train_main(base_args(tiny_run_inputs, tmp_path / "m", "recipe=medusa", "max_steps=1",
                                f"init_heads={first / 'final'}")) == 2
    assert "holds eagle heads; this recipe can only start from medusa heads" in capsys.readouterr().err
    assert train_main(base_args(tiny_run_inputs, tmp_path / "w", "max_steps=1", "heads.aux_layers=[1]",
                                f"init_heads={first / 'final'}")) == 2
    assert "does not fit the heads this config builds" in capsys.readouterr().err


def test_unknown_config_key_suggests_the_nearest(tmp_path):
    def load(*overrides):
        return load_train_config(None, ["recipe=eagle", *overrides])

    with pytest.raises(ValueError, match="did you mean 'max_steps'"):
        load("max_step=3")
    with pytest.raises(ValueError, match="did you mean 'max_conversations'"):
        load("data.max_conversation=3")
    with pytest.raises(ValueError, match="must be an integer"):
        load("max_steps=ten")
    assert load("heads.aux_layers=[2,15,27]").heads.aux_layers == (2, 15, 27)
    with pytest.raises(ValueError, match=r"'heads.aux_layers\[1\]' must be an integer"):
        load("heads.aux_layers=[2,x]")
    with pytest.raises(ValueError, match="not both 0"):
        load("heads.reg_weight=0", "heads.cls_weight=0")
    assert load("optim.lr=3e-4").optim.lr == 3e-4  # YAML 1.1 reads this as a string
    with pytest.raises(ValueError, match="measure_chain must be a chain length in 1..99, or 0 to skip"):
        load("measure_chain=-1")


def test_each_recipe_reads_its_own_heads_section():
    from specheads.train.objective import OBJECTIVES

    medusa = load_train_config(None, ["recipe=medusa", "heads.num_heads=3"])
    assert type(medusa.heads) is OBJECTIVES.get("medusa").settings and medusa.heads.num_heads == 3
    assert medusa.output_dir == "runs/medusa"  # the default follows the recipe
    with pytest.raises(ValueError, match=r"config key heads.medusa_heads is now heads.num_heads; rename it"):
        load_train_config(None, ["recipe=medusa", "heads.medusa_heads=3"])
    with pytest.raises(ValueError, match=r"unknown config key heads.'aux_layers'"):  # an eagle setting
        load_train_config(None, ["recipe=medusa", "heads.aux_layers=[2,15,27]"])
    with pytest.raises(ValueError, match=r"the config names no recipe; add recipe: one of dflash, dflash2, distill, "
                                         r"domino, dspark, eagle, eagle3, medusa, medusa2, peagle, xpress"):
        load_train_config(None, ["max_steps=3"])
    with pytest.raises(ValueError, match=r"unknown recipe 'eagel' \(did you mean 'eagle'\?\)"):
        load_train_config(None, ["recipe=eagel"])


def test_every_recipe_file_parses():
    recipes = sorted((REPO / "configs").glob("*-smollm2-*.yaml"))
    assert recipes, "no recipes in configs/"
    for path in recipes:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and "specheads.train" in first, path  # each recipe begins with its command
        load_train_config(path, [])


def test_wandb_offline_writes_the_run(tiny_run_inputs, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "max_steps=3", "save_every=3", "report_to=wandb")) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_learning_rate_follows_the_configured_schedule(tiny_run_inputs, tmp_path, schedule):
    import math

    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "max_steps=6", "save_every=6", "measure_prompts=0",
                                "optim.lr=0.01", f"optim.schedule={schedule}")) == 0
    logged = {r["step"]: r["lr"] for r in metrics(out) if "lr" in r}
    for step in range(2, 7):  # after the 2 warm-up steps, decaying to 0 at step 6
        done = (step - 2) / 4
        factor = 1 - done if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done))
        assert logged[step] == pytest.approx(0.01 * factor, abs=1e-12), (step, logged)


def test_runs_with_one_split_seed_train_on_the_same_rows_and_share_the_feature_cache(tiny_run_inputs, tmp_path):
    """A seed study: `seed` changes initialisation and batch order while `data.split_seed` holds the split, so the
    second run finds its rows' features cached. Without a split seed, another seed splits elsewhere and the cache
    is written again (the control that shows the first check can fail)."""
    cache = tmp_path / "features"
    common = ("features=offline", "feature_dtype=float32", f"feature_cache_dir={cache}", "max_steps=2",
              "save_every=2", "eval_every=2", "measure_prompts=0")

    def written() -> int:
        return (cache / "train" / "index.json").stat().st_mtime_ns

    assert train_main(base_args(tiny_run_inputs, tmp_path / "a", *common, "seed=0", "data.split_seed=0")) == 0
    first = written()
    assert train_main(base_args(tiny_run_inputs, tmp_path / "b", *common, "seed=1", "data.split_seed=0")) == 0
    assert written() == first
    assert train_losses(tmp_path / "b") != train_losses(tmp_path / "a")  # the seed itself still counts
    assert train_main(base_args(tiny_run_inputs, tmp_path / "c", *common, "seed=1")) == 0
    assert written() != first


def test_max_minutes_ends_the_run_at_the_first_step_past_it_as_its_last_and_annealed(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    # 6 ms: past by the end of the first step, which is then evaluated, saved and measured like a last step
    budget = ("max_steps=1000", "max_minutes=0.0001", "optim.warmup_steps=0", "eval_every=500", "save_every=500",
              "log_every=500")
    assert train_main(base_args(tiny_run_inputs, out, *budget)) == 0
    rows = metrics(out)
    assert max(r["step"] for r in rows) == 1 and [r["step"] for r in rows if "loss" in r] == [1]
    assert [r["lr"] for r in rows if "loss" in r] == [0.0]  # the schedule ends with the minutes, not at step 1000
    assert any("eval/top1_step1" in r for r in rows) and "eval/measured_tau" in rows[-1]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"] and (out / "final" / "config.json").is_file()
    clock = json.loads((out / "checkpoints" / "step_1" / "trainer_state.json").read_text())["clock"]
    assert clock["used"] >= 0.0001 and clock["warmup_end"] == 0.0
    # resumed, the run has spent its minutes: it trains no more
    assert train_main(base_args(tiny_run_inputs, out, *budget, "resume=true")) == 0
    assert max(r["step"] for r in metrics(out)) == 1
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        load_train_config(None, ["recipe=eagle", "max_minutes=0"])

"""A kind added through the registries alone (tests/toy_kind.py, walked through in docs/adding-a-drafter.md):
it trains with the one recipe, decodes with `--method toy`, shows up in bench and the CLI, and passes every
check a built-in kind passes."""

from __future__ import annotations

import json

import pytest

from specheads.inference import Engine
from specheads.inference.bench.method_spec import parse_methods
from specheads.inference.cli import build_parser
from specheads.inference.methods import METHODS, option_flags
from specheads.inference.proposers import AutoregressiveProposer
from specheads.kinds import KINDS
from specheads.target import load_target
from specheads.train.__main__ import main as train_main
from tests import toy_kind
from tests.conftest import base_args
from tests.drafters import (
    DRAFTERS,
    DrafterCase,
    check_greedy_equals_plain_greedy,
    check_roundtrip,
    check_sampling_preserves_the_target_distribution,
    check_strict_loader,
    perturbed,
    proposer_for,
)


@pytest.fixture
def toy():
    toy_kind.register()
    DRAFTERS["toy"] = DrafterCase(
        lambda target: perturbed(toy_kind.build_toy(toy_kind.ToyHeadsConfig(), target, None),
                                 scale=0.02).to(target.device),
        [{"lookup": 0}, {}])
    yield
    toy_kind.unregister()
    del DRAFTERS["toy"]


def test_toy_passes_every_drafter_check(toy, target, tmp_path):
    check_greedy_equals_plain_greedy("toy", target, tmp_path / "golden")
    check_roundtrip("toy", target, tmp_path / "roundtrip")
    check_strict_loader("toy", target, tmp_path / "strict")


@pytest.mark.usefixtures("one_thread")
def test_toy_sampling_is_exact(toy, tmp_path):
    check_sampling_preserves_the_target_distribution("toy", tmp_path)


def test_toy_trains_with_the_recipe_and_is_offered_everywhere(toy, tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "recipe=toy", "heads.label_smoothing=0.1", "max_steps=6",
                                "save_every=6", "eval_every=3", "optim.lr=0.01")) == 0
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["kind"] == "toy" and set(saved["config"]) == {"hidden_size", "vocab_size"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/top1" in r] == [3, 6] and "eval/measured_tau" in rows[-1]

    target, _ = load_target(str(tiny_run_inputs[0]))
    prompt = [1, 5, 9, 12, 2, 1, 20, 23, 26, 29]
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24).output_ids
    assert Engine(target, proposer_for("toy", target, out / "final", {})).generate(
        prompt, max_new_tokens=24).output_ids == plain

    assert "toy" in KINDS and parse_methods(f"ar,toy:{out / 'final'}+lookup=0")[1].options.lookup == 0
    assert "toy" in build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    heads = next(f for f in option_flags() if f.name == "heads")
    assert "toy" in heads.help.split(":")[0]  # the --heads flag lists every method that takes it
    with pytest.raises(ValueError, match="--tree does not apply to --method toy"):
        METHODS.get("toy").make_options({"heads": "x", "tree": "cpu"})


def test_registries_are_left_as_they_were():
    assert "toy" not in KINDS and "toy" not in METHODS and "toy" not in DRAFTERS

"""scripts/lab/compare_trainers.py: the variants of our recipe it trains beside the peer's."""

from __future__ import annotations

import argparse

import pytest

from tests.scripts.lab import load_script


def test_a_variant_is_a_name_and_its_overrides():
    script = load_script("compare_trainers")
    assert script.variant("peer-layout:heads.ttt_decay=1.0,heads.norm_before_residual=true") == (
        "peer-layout", ["heads.ttt_decay=1.0", "heads.norm_before_residual=true"])


@pytest.mark.parametrize("text", ["equal-steps", "equal-steps:", ":heads.ttt_decay=1.0", "a/b:heads.ttt_decay=1.0",
                                  "equal-steps:heads.ttt_decay"])
def test_a_malformed_variant_is_refused_with_the_form_to_write(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:KEY=VALUE"):
        load_script("compare_trainers").variant(text)


def test_seeds_are_distinct_integers_and_only_other_seeds_rename_the_folders():
    script = load_script("compare_trainers")
    assert script.seed_list("0,1,2") == [0, 1, 2]
    for text in ("", "0,0", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct integer seeds"):
            script.seed_list(text)
    assert script.seeded("ours-muon", 0, 0) == "ours-muon" and script.seeded("peer", 2, 0) == "peer-s2"


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_speculators_parser_gives_the_peer_our_drafters_shape(kind):
    """The peer's shape arguments are flags speculators' trainer reads, with our config's values."""
    pytest.importorskip("speculators")
    from speculators.train.config import TrainConfig

    from specheads.train.config import load_train_config

    script = load_script("compare_trainers")
    cfg = load_train_config(str(script.ROOT / "configs" / f"{kind}-smollm2-cpu.yaml"), [])
    shape = script.peer_shape(kind, cfg, {"mask_token_id": 49151})
    peer = TrainConfig.resolve(["--speculator-type", kind, "--verifier-name-or-path", "unused", "--data-path",
                                "unused", "--save-path", "unused", *shape]).flatten()
    if kind == "eagle3":
        assert peer["ttt_steps"] == cfg.heads.ttt_steps
    else:
        assert (peer["num_depths"], peer["down_sample_ratio"], peer["down_sample_ratio_min"], peer["mask_token_id"]) \
            == (cfg.heads.num_depths, cfg.heads.down_sample_ratio, cfg.heads.down_sample_ratio_min, 49151)

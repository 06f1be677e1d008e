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

"""scripts/compare_trainers.py: the variants of our recipe it trains beside the peer's."""

from __future__ import annotations

import argparse

import pytest

from tests.scripts import load_script


def test_a_variant_is_a_name_and_its_overrides():
    script = load_script("compare_trainers")
    assert script.variant("peer-layout:heads.ttt_decay=1.0,heads.norm_before_residual=true") == (
        "peer-layout", ["heads.ttt_decay=1.0", "heads.norm_before_residual=true"])


@pytest.mark.parametrize("text", ["equal-steps", "equal-steps:", ":heads.ttt_decay=1.0", "a/b:heads.ttt_decay=1.0",
                                  "equal-steps:heads.ttt_decay"])
def test_a_malformed_variant_is_refused_with_the_form_to_write(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:KEY=VALUE"):
        load_script("compare_trainers").variant(text)

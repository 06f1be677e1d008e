"""Settings validation composes itself (`specheads.checked`): every part's `_check` runs once, root first, and no
class calls another's by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specheads.checked import Checked
from specheads.heads.dflash2 import DFlash2Config
from specheads.heads.dspark import DSparkConfig
from specheads.heads.peagle import PEagleConfig
from specheads.train.dflash import DFlashHeadsConfig
from specheads.train.peagle import PEagleHeadsConfig
from specheads.train.xpress import XPressHeadsConfig

ROOT = Path(__file__).resolve().parents[1]
HEAD = dict(hidden_size=32, vocab_size=100, aux_layers=(1, 2))  # the fields a fused-layer head config requires


@dataclass
class Root(Checked):
    log: list[str] = field(default_factory=list)

    def _check(self) -> None:
        self.log.append("Root")


@dataclass
class Left(Root):
    def _check(self) -> None:
        self.log.append("Left")


@dataclass
class Right(Root):
    def _check(self) -> None:
        self.log.append("Right")


@dataclass
class Bottom(Left, Right):
    def _check(self) -> None:
        self.log.append("Bottom")


@dataclass
class Unchecked(Left):
    """Adds no rule of its own: its parents' checks run, the inherited `_check` not a second time."""


def test_a_diamond_runs_every_check_once_root_first():
    assert Bottom().log == ["Root", "Right", "Left", "Bottom"]  # the MRO (Bottom, Left, Right, Root) reversed
    assert Unchecked().log == ["Root", "Left"]


@dataclass(frozen=True, kw_only=True)
class Passes(Checked):
    a: int = 1

    def _check(self) -> None:
        if self.a < 1:
            raise ValueError("a must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Fails(Checked):
    b: int = 0

    def _check(self) -> None:
        if self.b < 1:
            raise ValueError("b must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Mixed(Passes, Fails):
    """Mixes two parts and writes no check: the second part's rule still holds."""


def test_no_part_of_a_mixed_class_is_skipped():
    with pytest.raises(ValueError, match="b must be >= 1"):
        Mixed()
    with pytest.raises(ValueError, match="a must be >= 1"):
        Mixed(a=0, b=1)
    assert Mixed(b=1).a == 1


def test_a_post_init_below_checked_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="_check"):
        @dataclass
        class Replaces(Root):
            def __post_init__(self) -> None:
                pass


@pytest.mark.parametrize(("cls", "bad", "message"), [
    (DFlashHeadsConfig, {"loss": "nope"}, "heads.loss 'nope' is unknown"),  # FusedHeadsConfig
    (DFlashHeadsConfig, {"block_size": 1}, "dflash block_size must be >= 2"),  # DraftBlock, by the kind's name
    (DFlashHeadsConfig, {"max_anchors": 0}, "heads.max_anchors must be >= 1"),  # BlockTraining
    (DFlashHeadsConfig, {"position_decay": 0.0}, "heads.position_decay must be > 0"),  # PositionWeighting
    (XPressHeadsConfig, {"xpress_rank": 0}, "xpress xpress_rank must be >= 1"),  # XPressBlock
    (XPressHeadsConfig, {"consistency_passes": -1}, "heads.consistency_passes must be >= 0"),  # its own
    (PEagleHeadsConfig, {"norm_before_fc": True, "fc_norm": True}, "exclude each other"),  # ChainLayout
    (PEagleHeadsConfig, {"num_depths": 0}, "peagle num_depths must be >= 1"),  # PEagleBlock
    (PEagleHeadsConfig, {"down_sample_ratio": 0.0}, "heads.down_sample_ratio must be in"),  # its own
    (DSparkConfig, {**HEAD, "markov_rank": -1}, "dspark markov_rank must be >= 0"),  # DSparkBlock
    (DSparkConfig, {**HEAD, "block_size": 1}, "dspark block_size must be >= 2"),  # DraftBlock
    (DSparkConfig, {**HEAD, "layer": {"hidden": 1}}, "dspark layer may only set"),  # BlockDrafterConfig
    (DFlash2Config, {**HEAD, "conv_kernel_size": 9}, "reaches past a block"),  # DFlash2Block
    (DFlash2Config, {**HEAD, "conv_group_size": 5}, "does not divide the hidden size"),  # its own
    (PEagleConfig, {**HEAD, "mask_token_id": 100}, "peagle mask_token_id 100 is outside"),  # FusedChainConfig
    (PEagleConfig, {**HEAD, "num_depths": 0}, "peagle num_depths must be >= 1"),  # PEagleBlock
])
def test_the_settings_classes_run_every_part_they_mix(cls, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**bad)


def test_checks_still_normalise_fields():
    assert DFlashHeadsConfig(aux_layers=[1, 2]).aux_layers == (1, 2)
    config = PEagleConfig(**{**HEAD, "aux_layers": [3, 4]}, draft_vocab=[2, 5])  # as JSON gives them
    assert (config.aux_layers, config.draft_vocab) == ((3, 4), (2, 5))


def test_no_class_calls_another_classes_post_init_by_hand():
    """Such a call is what `Checked` replaces: a class mixing several parts that forgets one skips its check."""
    found = [f"{path.relative_to(ROOT)}:{number}"
             for folder in ("specheads", "train", "inference") for path in sorted((ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if ".__post_init__(self)" in line]
    assert not found, f"define _check(self) on the class instead (specheads.checked): {found}"

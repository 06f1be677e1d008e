"""What `--heads` names is read in one place (`specheads.formats.load`): our folders whole, another engine's through
the importers, and anything else refused naming what it accepts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from specheads.formats.load import read_heads
from specheads.heads.checkpoint import CONFIG_NAME, TargetInfo, save_heads
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2)


def save_ours(path, target) -> None:
    torch.manual_seed(0)
    module = nn.Module()
    module.own = nn.Linear(8, 4)
    save_heads(path, module, kind="toy", config={"width": 4}, target=TargetInfo.from_model(target, "tiny"))


def test_our_folder_reads_whole(tmp_path, target):
    save_ours(tmp_path, target)
    ckpt = read_heads(tmp_path)
    assert (ckpt.path, ckpt.kind, ckpt.config, ckpt.target, ckpt.metadata) == (
        tmp_path, "toy", {"width": 4}, TargetInfo.from_model(target, "tiny"), {})
    assert ckpt.state.keys() == {"own.weight", "own.bias"}


def test_a_folder_neither_ours_nor_a_known_layout_is_refused_naming_the_fix(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"architectures": ["Mystery"]}))
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds no drafter layout specheads reads: its config.json has no 'kind' "
                                         r"\(our format\) and matches none of: .*Pass a specheads training run's "
                                         r"final/ folder or one of those"):
        read_heads(tmp_path)


@pytest.mark.parametrize("damage", ["no-folder", "no-config", "bad-json", "not-an-object", "missing-key"])
def test_broken_folders_are_refused_as_before(tmp_path, target, damage):
    folder = tmp_path / "ckpt"
    save_ours(folder, target)
    if damage == "no-folder":
        folder = tmp_path / "nowhere"
    elif damage == "no-config":
        (folder / CONFIG_NAME).unlink()
    elif damage == "bad-json":
        (folder / CONFIG_NAME).write_text('{"kind": "toy", ')
    elif damage == "not-an-object":
        (folder / CONFIG_NAME).write_text("[1, 2]")
    elif damage == "missing-key":
        meta = json.loads((folder / CONFIG_NAME).read_text())
        del meta["target"]
        (folder / CONFIG_NAME).write_text(json.dumps(meta))
    expected = {"no-folder": "does not exist or is not a folder", "no-config": "has no config.json",
                "bad-json": "is corrupt", "not-an-object": r"lacks \['config', 'target', 'format_version'\]",
                "missing-key": r"lacks \['target'\]"}[damage]
    with pytest.raises(ValueError, match=expected):
        read_heads(folder)

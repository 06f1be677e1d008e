"""What `--heads` names is read in one place (`specheads.formats.load`): our folders as the checkpoint module reads
them, another engine's through the importers; the checkpoint module itself reads only ours."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from specheads.formats.load import read_heads
from specheads.heads.checkpoint import CONFIG_NAME, TargetInfo, read_checkpoint, save_heads
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2)


def save_ours(path, target) -> None:
    torch.manual_seed(0)
    module = nn.Module()
    module.own = nn.Linear(8, 4)
    save_heads(path, module, kind="toy", config={"width": 4}, target=TargetInfo.from_model(target, "tiny"))


def test_our_folder_reads_the_same_through_either_reader(tmp_path, target):
    save_ours(tmp_path, target)
    ours, any_ = read_checkpoint(tmp_path), read_heads(tmp_path)
    assert (any_.path, any_.kind, any_.config, any_.target, any_.metadata) == (
        ours.path, ours.kind, ours.config, ours.target, ours.metadata)
    assert any_.state.keys() == ours.state.keys()
    assert all(torch.equal(any_.state[k], ours.state[k]) for k in ours.state)


def test_a_foreign_folder_goes_to_the_importers_and_the_checkpoint_module_points_there(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"architectures": ["Mystery"]}))
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds no drafter layout specheads reads.*matches none of"):
        read_heads(tmp_path)
    with pytest.raises(ValueError, match=r"not specheads' own format.*specheads\.formats\.load\.read_heads"):
        read_checkpoint(tmp_path)


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
    for read in (read_heads, read_checkpoint):
        with pytest.raises(ValueError, match=expected):
            read(folder)

"""The shared heads checkpoint: roundtrip, target checks, corrupt files, atomic writes."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from torch import nn

from specheads.formats.load import read_heads
from specheads.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, TargetInfo, save_heads
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2)


def small_module() -> nn.Module:
    torch.manual_seed(0)
    module = nn.Module()
    module.own = nn.Linear(64, 32)  # big enough that half the file ends inside the tensor data
    module.shared = nn.Linear(32, 5, bias=False)
    return module


def save_small(path, target) -> nn.Module:
    module = small_module()
    save_heads(path, module, kind="toy", config={"width": 4}, target=TargetInfo.from_model(target, "tiny"),
               exclude_prefixes=("shared.",))
    return module


def test_target_info_from_model(target):
    info = TargetInfo.from_model(target, "tiny")
    assert info == TargetInfo(name="tiny", model_type="llama", hidden_size=64, vocab_size=96, num_layers=2)


def test_roundtrip_excludes_prefixes_and_leaves_no_temp_files(tmp_path, target):
    module = save_small(tmp_path / "ckpt", target)
    ckpt = read_heads(tmp_path / "ckpt")
    assert ckpt.kind == "toy" and ckpt.config == {"width": 4} and ckpt.metadata == {}
    assert ckpt.target == TargetInfo.from_model(target, "tiny")
    assert set(ckpt.state) == {"own.weight", "own.bias"}
    torch.testing.assert_close(ckpt.state["own.weight"], module.own.weight)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert json.loads((tmp_path / "ckpt" / CONFIG_NAME).read_text())["format_version"] == 3
    # Overwriting in place also leaves only the two files.
    save_small(tmp_path / "ckpt", target)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


def test_failed_save_keeps_old_checkpoint_and_no_temp_files(tmp_path, target):
    save_small(tmp_path, target)
    before = (tmp_path / WEIGHTS_NAME).read_bytes()
    with pytest.raises(TypeError):  # config not JSON-serialisable: fails before touching any file
        save_heads(tmp_path, small_module(), kind="toy", config={"bad": object()},
                   target=TargetInfo.from_model(target, "tiny"))
    assert (tmp_path / WEIGHTS_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


def test_target_info_from_config_reads_the_config_vocabulary_and_from_model_the_lm_head_rows(target):
    assert TargetInfo.from_config(target.config, "tiny") == TargetInfo.from_model(target, "tiny")
    padded = tiny_model("llama", layers=2)
    padded.lm_head = nn.Linear(64, 128, bias=False)  # a padded LM head: more rows than config.vocab_size
    assert TargetInfo.from_config(padded.config, "p").vocab_size == 96
    assert TargetInfo.from_model(padded, "p").vocab_size == 128


def test_mismatched_target_names_each_differing_size(tmp_path, target):
    info = TargetInfo(name="SmolLM2-135M", model_type="llama", hidden_size=576, vocab_size=49152, num_layers=30)
    message = (rf"heads in {re.escape(str(tmp_path))} were trained for target SmolLM2-135M \(hidden 576, vocab 49152, "
               r"30 layers\), not this target: hidden size 576 \(heads\) vs 64 \(target\); vocabulary 49152 \(heads\) "
               r"vs 96 \(target\); layers 30 \(heads\) vs 2 \(target\); train heads for this target or pass the "
               r"matching --target")
    with pytest.raises(ValueError, match=message):
        info.check_compatible(target, checkpoint=tmp_path)
    other_layers = TargetInfo.from_model(tiny_model("llama", layers=3), "x")
    with pytest.raises(ValueError, match=r"these heads were .*not this target: layers 3 \(heads\) vs 2 \(target\);"):
        other_layers.check_compatible(target)


def test_unrecorded_layer_count_is_not_checked(target):
    """An imported foreign checkpoint records no depth: its heads are checked on hidden size and vocabulary only."""
    info = TargetInfo(name="foreign", model_type="", hidden_size=64, vocab_size=96, num_layers=None)
    info.check_compatible(tiny_model("llama", layers=3))
    with pytest.raises(ValueError, match=r"not this target: vocabulary 96 \(heads\) vs 128 \(target\); pass it"):
        info.check_sizes(TargetInfo.from_config(tiny_model("llama", vocab=128).config, "t"),
                         subject="these heads were", fix="pass it")


def test_name_mismatch_only_warns(target, caplog):
    info = TargetInfo.from_model(target, "org/tiny")
    with caplog.at_level(logging.WARNING):
        info.check_compatible(target, "local/tiny-copy")
    assert "local/tiny-copy" in caplog.text


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut inside the tensor data, cut inside the header
def test_truncated_weights_raise_clear_error(tmp_path, target, keep):
    save_small(tmp_path, target)
    data = (tmp_path / WEIGHTS_NAME).read_bytes()
    (tmp_path / WEIGHTS_NAME).write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="corrupt or truncated.*re-export or re-train"):
        read_heads(tmp_path)


@pytest.mark.parametrize("damage", ["no-folder", "no-config", "bad-json", "missing-key", "no-weights"])
def test_broken_checkpoints_raise_value_error(tmp_path, target, damage):
    save_small(tmp_path / "ckpt", target)
    ckpt = tmp_path / "ckpt"
    if damage == "no-folder":
        ckpt = tmp_path / "nowhere"
    elif damage == "no-config":
        (ckpt / CONFIG_NAME).unlink()
    elif damage == "bad-json":
        (ckpt / CONFIG_NAME).write_text('{"head_type": "toy", ')
    elif damage == "missing-key":
        meta = json.loads((ckpt / CONFIG_NAME).read_text())
        del meta["target"]
        (ckpt / CONFIG_NAME).write_text(json.dumps(meta))
    elif damage == "no-weights":
        (ckpt / WEIGHTS_NAME).unlink()
    expected = {"no-folder": "does not exist", "no-config": "has no config.json", "bad-json": "corrupt",
                "missing-key": "lacks.*target", "no-weights": "has no model.safetensors"}[damage]
    with pytest.raises(ValueError, match=expected):
        read_heads(ckpt)


def test_format_1_checkpoints_still_load_with_their_eval_as_metadata(tmp_path, target):
    save_small(tmp_path, target)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta.pop("metadata")
    meta["head_type"] = meta.pop("kind")  # formats 1 and 2 named the kind `head_type`
    meta["format_version"], meta["config"]["eval"] = 1, {"step": 3}  # format 1 kept the last eval in `config`
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    ckpt = read_heads(tmp_path)
    assert ckpt.config == {"width": 4} and ckpt.metadata == {"eval": {"step": 3}}
    meta["format_version"] = 4
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format_version 4, this specheads reads versions 1, 2, 3: upgrade specheads"):
        read_heads(tmp_path)


def test_format_2_checkpoints_name_their_kind_head_type_and_still_load(tmp_path, target):
    save_small(tmp_path, target)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta["head_type"], meta["format_version"] = meta.pop("kind"), 2
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    assert read_heads(tmp_path).kind == "toy"
    meta["format_version"] = 3  # format 3 calls it `kind`: a format-3 file with the old key is incomplete
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"format 3 lacks \['kind'\]"):
        read_heads(tmp_path)

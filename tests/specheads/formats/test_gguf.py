"""EAGLE-3 (and P-EAGLE) heads to llama.cpp's GGUF through llama.cpp's own converter: what it writes is read back
and matches the heads; what llama.cpp's EAGLE-3 graph cannot compute, or a target the heads were not trained for,
is refused by name before the converter runs; and the check after it catches a file that differs from the heads.
(llama.cpp decoding with these files: tests/specheads/llamacpp/test_server.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from specheads.config import build
from specheads.formats.base import layer_config
from specheads.formats.export import export, is_target
from specheads.formats.gguf import check_drafter_gguf, read_gguf
from specheads.heads.eagle3 import Eagle3Config
from specheads.heads.peagle import PEagleConfig, PEagleHead
from tests.drafters import perturbed
from tests.specheads.llamacpp.tiny import AUX, DRAFT_VOCAB, eagle3_heads, save_heads, smol_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol-tiny")
    return smol_tiny_target(folder), folder


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    model, folder = target
    root = tmp_path_factory.mktemp("gguf")
    heads = save_heads(root / "heads", eagle3_heads(model), model, folder)
    done = export(heads, "gguf", root / "out", target=str(folder))
    return heads, done


def test_the_export_is_what_llamacpp_reads_of_these_heads(exported):
    heads, done = exported
    assert done.files == ["eagle3-f32.gguf", "README.md"]
    meta, tensors = read_gguf(done.folder / "eagle3-f32.gguf")
    assert meta["general.architecture"] == "eagle3"
    assert list(meta["eagle3.target_layers"]) == list(AUX)
    assert meta["eagle3.target_hidden_size"] == 64 and meta["eagle3.block_count"] == 1
    assert len(meta["tokenizer.ggml.tokens"]) == 49152  # the target's tokenizer, not a draft vocabulary
    assert np.asarray(tensors["d2t"][1]).tolist() == list(DRAFT_VOCAB)  # absolute target ids, row by row
    assert "token_embd.weight" not in tensors  # shared with the target's
    state = json.loads((heads / "config.json").read_text())
    assert state["kind"] == "eagle3"
    # the tensors are the heads' own, in f32: llama.cpp's fc is ours
    from safetensors.torch import load_file

    ours = load_file(heads / "model.safetensors")
    assert np.array_equal(np.asarray(tensors["fc.weight"][1]), ours["fc.weight"].numpy())
    assert "llama-server -m TARGET.gguf -md eagle3-f32.gguf --spec-type draft-eagle3" in (
        done.folder / "README.md").read_text()


def test_the_check_after_the_converter_catches_a_file_unlike_the_heads(exported, target):
    heads, done = exported
    cfg = build(Eagle3Config, json.loads((heads / "config.json").read_text())["config"])
    lc = layer_config(target[0].config, 1, cfg.layer)
    path = done.folder / "eagle3-f32.gguf"
    check_drafter_gguf(path, cfg, lc)  # the file as written passes
    with pytest.raises(RuntimeError, match="target_layers is"):
        check_drafter_gguf(path, replace(cfg, aux_layers=(1, 4, 5)), lc)
    shifted = tuple(i + 1 for i in DRAFT_VOCAB)
    with pytest.raises(RuntimeError, match="d2t maps draft row 0 elsewhere"):
        check_drafter_gguf(path, replace(cfg, draft_vocab=shifted), lc)
    with pytest.raises(RuntimeError, match=r"tensor output.weight is \(6000, 64\), not \(49152, 64\)"):
        check_drafter_gguf(path, replace(cfg, draft_vocab=None), lc)


@pytest.mark.parametrize(("config", "why"), [
    ({"num_layers": 2}, "2 decoder layers"),
    ({"aux_layers": (2, 5)}, "2 aux layers"),
    ({"fc_norm": True}, "fc_norm set"),
    ({"norm_output": True}, "norm_output set"),
])
def test_heads_llamacpp_cannot_compute_are_refused_before_the_converter(config, why, target, tmp_path):
    model, folder = target
    heads = save_heads(tmp_path / "heads", eagle3_heads(model, **config), model, folder)
    with pytest.raises(ValueError, match=f"llama.cpp's EAGLE-3 draft cannot express these eagle3 heads: .*{why}"):
        export(heads, "gguf", tmp_path / "out", target=str(folder))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_another_target_is_refused_naming_what_differs(target, tmp_path):
    model, folder = target
    heads = save_heads(tmp_path / "heads", eagle3_heads(model), model, folder)
    other = tmp_path / "other"
    smol_tiny_target(other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"trained for .* not this target: layers 8 \(heads\) vs 5 \(target\); pass "
                                         "the target they were trained for"):
        export(heads, "gguf", tmp_path / "out", target=str(other))


def test_heads_without_their_vocabulary_mapping_are_refused(target, tmp_path):
    """A speculators folder whose d2t was lost: its LM head scores 6000 rows of a 49152-token vocabulary."""
    from safetensors.torch import load_file, save_file

    model, folder = target
    heads = save_heads(tmp_path / "heads", eagle3_heads(model), model, folder)
    spec = export(heads, "speculators", tmp_path / "spec", target=str(folder)).folder
    weights = load_file(spec / "model.safetensors")
    del weights["d2t"], weights["t2d"]
    save_file(weights, spec / "model.safetensors")
    with pytest.raises(ValueError, match="no d2t mapping; re-export it with d2t"):
        export(spec, "gguf", tmp_path / "out", target=str(folder))


def test_kinds_llamacpp_has_no_draft_for_are_refused(target, tmp_path):
    from tests.drafters import DRAFTERS

    model, folder = target
    small = DRAFTERS["dflash"].make  # any block drafter
    from specheads.heads.checkpoint import TargetInfo, save_drafter
    from tests.conftest import tiny_model

    tiny = tiny_model("llama")
    tiny.save_pretrained(tmp_path / "tiny")
    save_drafter(tmp_path / "dflash", small(tiny), TargetInfo.from_model(tiny, str(tmp_path / "tiny")))
    with pytest.raises(ValueError, match="--to gguf cannot express dflash heads.*dflash heads export to: hf"):
        export(tmp_path / "dflash", "gguf", tmp_path / "out", target=str(tmp_path / "tiny"))


def test_peagle_heads_export_as_the_eagle3_draft_they_contain(target, tmp_path):
    model, folder = target
    torch.manual_seed(0)
    cfg = PEagleConfig(hidden_size=64, vocab_size=49152, aux_layers=AUX, draft_vocab=DRAFT_VOCAB, num_depths=3)
    heads = save_heads(tmp_path / "heads", perturbed(PEagleHead(cfg, model), scale=0.02).eval(), model, folder)
    done = export(heads, "gguf", tmp_path / "out", target=str(folder), precision="bf16")
    assert done.files == ["peagle-bf16.gguf", "README.md"]
    meta, tensors = read_gguf(done.folder / "peagle-bf16.gguf")
    assert meta["general.architecture"] == "eagle3" and "mask_hidden" not in tensors
    readme = (done.folder / "README.md").read_text()
    assert "--spec-draft-n-max 1" in readme and "never trained on" in readme


def test_a_target_folder_exports_as_its_own_gguf(target, tmp_path):
    model, folder = target
    assert is_target(folder) and is_target("default")
    done = export(folder, "gguf", tmp_path / "out", precision="q8_0")
    meta, tensors = read_gguf(done.folder / done.files[0])
    assert done.files == [f"{folder.name}-q8_0.gguf"]
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 8
    with pytest.raises(ValueError, match="q4_1 is the default target's shipped GGUF only"):
        export(folder, "gguf", tmp_path / "q4", precision="q4_1")


def test_outtype_is_for_gguf_only(exported, tmp_path):
    heads, _ = exported
    with pytest.raises(ValueError, match="--outtype sets a GGUF export's precision; --to speculators"):
        export(heads, "speculators", tmp_path / "out", precision="bf16")

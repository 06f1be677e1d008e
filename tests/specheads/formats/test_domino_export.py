"""Domino drafters in speculators' dflash layout with projector_type domino: the export's config keys and the
correction's tensor names and shapes exactly as speculators' DominoHead has them, the LM head the target's own;
importing it back gives the same tensors and config; the plain dflash importer leaves such a folder alone (and still
reads its own); what is not Domino's layout is refused by name; and the `speculators` package (whose releases load
Domino's DFlash backbone, not yet its correction) computes the same base logits from the export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from specheads.formats.base import import_folder
from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from tests.conftest import tiny_model
from tests.drafters import _dflash, _domino

H, V, G, E, BLOCK = 64, 96, 16, 8, 4
CORRECTION = {"domino_head.prefix_gru.weight_ih_l0": (3 * G, H), "domino_head.prefix_gru.weight_hh_l0": (3 * G, G),
              "domino_head.embed_proj.0.weight": (E, H + G), "domino_head.embed_proj.2.weight": (V, E)}


@pytest.fixture
def target_dir(tmp_path):
    target = tiny_model("llama")
    target.save_pretrained(tmp_path / "target")
    return target, tmp_path / "target"


def exported(target, target_path, folder, **settings):
    heads = _domino(target, **settings)
    save_drafter(folder / "heads", heads, TargetInfo.from_model(target, str(target_path)))
    export(folder / "heads", "speculators", folder / "spec")
    return heads, json.loads((folder / "spec" / "config.json").read_text())


def test_the_export_is_speculators_domino(target_dir, tmp_path):
    target, target_path = target_dir
    heads, config = exported(target, target_path, tmp_path, pure_draft_prefix_len=2)
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert (config["projector_type"], config["shift_label"], config["sample_from_anchor"]) == ("domino", True, False)
    assert (config["pure_draft_prefix_len"], config["emb_dim"], config["gru_hidden_dim"]) == (2, E, G)
    assert (config["block_size"], config["draft_vocab_size"], config["mask_token_id"]) == (BLOCK, V, V - 1)
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    # its engines fill a block of the anchor and speculative_tokens masks: the trained block
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    state = load_file(tmp_path / "spec" / "model.safetensors")
    assert {name: tuple(state[name].shape) for name in CORRECTION} == CORRECTION
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight) and "d2t" not in state  # the verifier's head
    for name in CORRECTION:
        assert torch.equal(state[name], heads.state_dict()[name])


def test_import_gives_back_the_same_tensors_and_config(target_dir, tmp_path):
    target, target_path = target_dir
    heads, _ = exported(target, target_path, tmp_path, pure_draft_prefix_len=0)
    back = load_heads(tmp_path / "spec", target, kind="domino")
    # the layer fields an import spells out are the target's own, which ours leaves implicit
    assert dataclasses.replace(back.config, layer={}) == heads.config
    assert back.config.layer["intermediate_size"] == target.config.intermediate_size
    want, got = heads.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    ckpt = import_folder(tmp_path / "spec", json.loads((tmp_path / "spec" / "config.json").read_text()))
    assert ckpt.kind == "domino" and ckpt.metadata["imported_from"] == "speculators domino"


def export_logits(folder, head, target):
    """The `speculators` package's logits for the export in `folder` at the slots after the anchor of the blocks its
    own training forward anchors, and `head`'s base logits there (its releases build the DFlash backbone and leave
    the correction's tensors unloaded)."""
    from tests.specheads.formats.test_dflash_interop import export_logits as dflash_logits

    return dflash_logits(folder, head, target)


@pytest.mark.interop
def test_speculators_loads_the_export_and_computes_the_same_base_logits(target_dir, tmp_path):
    pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                              "hs-connectors==0.9.0 (scripts/setup.sh does)")
    target, target_path = target_dir
    heads, _ = exported(target, target_path, tmp_path)
    theirs, want = export_logits(tmp_path / "spec", heads, target)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def test_the_dflash_importer_reads_only_plain_dflash(target_dir, tmp_path):
    target, target_path = target_dir
    save_drafter(tmp_path / "dflash", _dflash(target), TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "dflash", "speculators", tmp_path / "plain")
    meta = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "projector_type" not in meta and import_folder(tmp_path / "plain", meta).kind == "dflash"
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**meta, "projector_type": "dflash"}))
    assert load_heads(tmp_path / "plain", target).config.KIND == "dflash"  # speculators' default, written out
    exported(target, target_path, tmp_path)
    assert load_heads(tmp_path / "spec", target).config.KIND == "domino"


def test_what_is_not_dominos_layout_is_refused_by_name(target_dir, tmp_path):
    target, target_path = target_dir
    exported(target, target_path, tmp_path)
    path = tmp_path / "spec" / "config.json"
    config = json.loads(path.read_text())
    for key, value in (("shift_label", False), ("sample_from_anchor", True)):
        path.write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=rf"lays its slots out with shift_label .* {key} {value}|"
                                             rf"shift_label {value} and"):
            load_heads(tmp_path / "spec", target)
    path.write_text(json.dumps({**config, "draft_vocab_size": 64}))
    with pytest.raises(ValueError, match="scores 64 tokens of a 96-token vocabulary; Domino scores the whole"):
        load_heads(tmp_path / "spec", target)
    with pytest.raises(ValueError, match=r"--speculative-tokens 4: these domino heads draft 3 tokens per forward "
                                         r"\(block_size - 1: .*pass --speculative-tokens 3 or less"):
        export(tmp_path / "heads", "speculators", tmp_path / "more", speculative_tokens=4)
    assert not (tmp_path / "more").exists()
    export(tmp_path / "heads", "speculators", tmp_path / "fewer", speculative_tokens=2)
    fewer = json.loads((tmp_path / "fewer" / "config.json").read_text())
    assert fewer["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2

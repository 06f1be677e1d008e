"""The family × export matrix: for every decoder family of the family matrix (`tests.test_families.FAMILIES`) and
every registered exporter, heads of the exporter's kind for a tiny target of the family are exported; the export
imports back drafting the same tree, and its config names what the engine will load (the verifier's own classes,
layers of the target's sizes); speculators' own classes load every speculators export and draft the same logits as
the heads.

Where an engine's layers cannot hold the heads' (the heads copy a Llama-family target's layers, which carry tensors
Llama layers lack), the export is refused naming those tensors, and that refusal is what is checked.
"""

from __future__ import annotations

import json

import pytest
import torch

from specheads.draft_layers import mirrors_target
from specheads.formats.export import export
from tests.conftest import tiny_config, tiny_model
from tests.specheads.formats.test_export import EXPORTABLE, FORMATS, drafts, saved
from tests.test_families import FAMILIES

SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")

# Tensors of a Llama-family target's layers that the Llama layers of a loader cannot hold, by the heads' layer type:
# Qwen3's per-head q/k norms, which speculators' Qwen3 layers hold but SGLang's Llama layers do not. Block drafters
# (DFlash, DSpark, XPress) have layers of their own (speculators' Qwen3 DFlash layer), which every family fits.
UNHELD = {("qwen3", "sglang"): "self_attn.q_norm.weight"}
OWN_LAYERS = ("dflash", "dflash2", "domino", "dspark", "xpress")


def layer_type(arch: str) -> str:
    """The draft layers' type: the target's own where heads copy its layers, else Llama's (specheads.draft_layers)."""
    text = tiny_config(arch).get_text_config()
    return text.model_type if mirrors_target(text) else "llama"


def unheld(arch: str, fmt: str, kind: str) -> str | None:
    """The tensor the export of `kind` heads of an `arch` target to `fmt` is refused for; None where it writes."""
    return None if kind in OWN_LAYERS or fmt == "vllm-medusa" else UNHELD.get((layer_type(arch), fmt))


def named_layer_type(arch: str) -> str:
    """What an export names the draft layers: a Mistral layer is written as the Llama layer it is (speculators and
    SGLang build Llama and Qwen3 layers)."""
    return "llama" if layer_type(arch) == "mistral" else layer_type(arch)


def sizes(config) -> dict[str, int]:
    """The layer sizes of a config (an HF config or an exported dict), head_dim resolved where it is left out."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return {k: get(k) or (get("hidden_size") // get("num_attention_heads") if k == "head_dim" else None)
            for k in SIZES}


CASES = [(arch, fmt, kind) for arch in FAMILIES for fmt, kind in FORMATS]
WRITTEN = [case for case in CASES if unheld(*case) is None]
REFUSED = [case for case in CASES if unheld(*case) is not None]
SPECULATORS = [(arch, kind) for arch, fmt, kind in WRITTEN if fmt == "speculators"]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """A tiny target of the family `request.param` and the folder it is saved in (one per family, for every case)."""
    target = tiny_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / "target"
    target.save_pretrained(path)
    return request.param, target, path


def exported(family, fmt, kind, folder):
    """Heads of `kind` for the family's target (in the layout `fmt` expresses), exported: (heads, export config)."""
    arch, target, path = family
    heads = saved(kind, target, path, folder / "heads", EXPORTABLE.get((fmt, kind)))
    done = export(folder / "heads", fmt, folder / "out")
    assert done.verifier == str(path)
    return heads, json.loads((folder / "out" / "config.json").read_text())


def check_speculators(arch, target, heads, config):
    verifier = config["speculators_config"]["verifier"]
    assert verifier["architectures"] == [type(target).__name__], arch  # an image-text target's own class too
    layers = config["transformer_layer_config"]
    assert layers["model_type"] == named_layer_type(arch)
    assert layers["num_hidden_layers"] == heads.config.num_layers
    assert sizes(layers) == sizes(target.config.get_text_config())


def check_sglang_eagle3(arch, target, heads, config):
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["draft_vocab_size"]) == (heads.config.num_layers,
                                                                         heads.config.draft_vocab_size)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in heads.config.aux_layers]
    assert sizes(config) == sizes(target.config.get_text_config())


def check_sglang_eagle(arch, target, heads, config):
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == heads.config.num_layers
    assert sizes(config) == sizes(target.config.get_text_config())


def check_vllm_medusa(arch, target, heads, config):
    text = target.config.get_text_config()
    assert config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"]) == (text.hidden_size, text.vocab_size)
    assert (config["num_heads"], config["truncated_vocab_size"]) == (heads.config.num_heads,
                                                                     heads.config.scored_vocab_size)


# What each exporter's config must name for its engine (an exporter without an entry fails the matrix).
NAMES = {("speculators", "eagle3"): check_speculators, ("speculators", "peagle"): check_speculators,
         ("speculators", "dflash"): check_speculators, ("speculators", "dspark"): check_speculators,
         ("speculators", "xpress"): check_speculators, ("speculators", "dflash2"): check_speculators,
         ("speculators", "domino"): check_speculators,
         ("sglang", "eagle3"): check_sglang_eagle3,
         ("sglang", "eagle"): check_sglang_eagle, ("vllm-medusa", "medusa"): check_vllm_medusa}


@pytest.mark.parametrize(("family", "fmt", "kind"), WRITTEN, indirect=["family"], scope="module")
def test_every_family_exports_to_every_format_and_the_export_drafts_the_same_tree(family, fmt, kind, tmp_path):
    arch, target, _ = family
    heads, config = exported(family, fmt, kind, tmp_path)
    assert drafts(kind, target, tmp_path / "out") == drafts(kind, target, tmp_path / "heads"), (arch, fmt, kind)
    NAMES[fmt, kind](arch, target, heads, config)


@pytest.mark.parametrize(("family", "fmt", "kind"), REFUSED, indirect=["family"], scope="module")
def test_an_export_whose_layers_the_engine_cannot_hold_is_refused_naming_the_tensor(family, fmt, kind, tmp_path):
    with pytest.raises(ValueError, match=rf"has tensors \[.*'[\w.]*{unheld(family[0], fmt, kind)}'.*\] that its "
                                         "loader would silently drop"):
        exported(family, fmt, kind, tmp_path)
    assert not (tmp_path / "out").exists()  # refused before a file is written


@pytest.mark.interop
@pytest.mark.parametrize(("family", "kind"), SPECULATORS, indirect=["family"], scope="module")
def test_speculators_loads_every_familys_export_and_drafts_the_same_logits(family, kind, tmp_path):
    pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                              "hs-connectors==0.9.0 (scripts/setup.sh does)")
    from tests.specheads.formats import (
        test_dflash2_interop,
        test_dflash_interop,
        test_domino_export,
        test_dspark_interop,
        test_eagle3_interop,
        test_peagle_interop,
        test_xpress_interop,
    )

    peers = {"eagle3": test_eagle3_interop, "peagle": test_peagle_interop, "dflash": test_dflash_interop,
             "dspark": test_dspark_interop, "xpress": test_xpress_interop, "dflash2": test_dflash2_interop,
             "domino": test_domino_export}  # speculators' releases load Domino's backbone: its base logits
    arch, target, _ = family
    heads, _ = exported(family, "speculators", kind, tmp_path)
    theirs, want = peers[kind].export_logits(tmp_path / "out", heads, target)
    # the peer's eager attention against the heads' SDPA: equal up to fp32 rounding of two kernels
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{arch} {kind}: {m}")


def test_every_exporter_has_its_engines_names_checked():
    assert sorted(NAMES) == sorted(FORMATS)

import pytest
import torch
from transformers import AutoModelForCausalLM

from specheads.gemm_layout import linear_layout, resolve_layout, set_linear_layout
from specheads.target import load_target
from tests.conftest import tiny_config


def test_auto_is_column_major_for_fp32_on_cpu_only():
    assert resolve_layout("auto", "cpu", torch.float32) == "column"
    assert resolve_layout("auto", "cpu", torch.bfloat16) == "row"
    assert resolve_layout("auto", "cuda", torch.float32) == "row"
    assert resolve_layout("row", "cpu", torch.float32) == "row"
    with pytest.raises(ValueError, match="unknown weight layout 'cols'; use one of: auto, row, column"):
        resolve_layout("cols", "cpu", torch.float32)


def test_column_major_keeps_values_names_and_ties():
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 9, 2, 7]])
    logits = model(ids).logits
    set_linear_layout(model, "column")
    assert linear_layout(model) == "column"
    weight = model.model.layers[0].mlp.up_proj.weight
    assert not weight.is_contiguous() and weight.t().is_contiguous()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tied parameter
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    set_linear_layout(model, "row")
    assert linear_layout(model) == "row" and model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    with pytest.raises(ValueError, match="'row' or 'column'"):
        set_linear_layout(model, "auto")


def test_load_target_applies_the_layout(tiny_model_dir):
    assert linear_layout(load_target(str(tiny_model_dir))[0]) == "row"  # training's default: as loaded
    assert linear_layout(load_target(str(tiny_model_dir), weight_layout="auto")[0]) == "column"
    assert linear_layout(load_target(str(tiny_model_dir), dtype="bf16", weight_layout="auto")[0]) == "row"

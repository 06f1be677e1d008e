import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from specheads import gemm_layout
from specheads.gemm_choice import BUCKETS
from specheads.gemm_layout import (
    PlannedLinear,
    layout_plans,
    linear_layout,
    packing_available,
    resolve_layout,
    set_linear_layout,
)
from specheads.target import load_target
from tests.conftest import tiny_config


def test_auto_is_measured_for_fp32_on_cpu_and_packed_for_native_bf16(monkeypatch):
    assert resolve_layout("auto", "cpu", torch.float32) == "measured"
    assert resolve_layout("auto", "cuda", torch.float32) == "row"
    assert resolve_layout("auto", "cuda", torch.bfloat16) == "row"
    assert resolve_layout("row", "cpu", torch.float32) == "row"
    monkeypatch.setattr(gemm_layout, "cpu_has_native_bf16", lambda: False)  # bf16 emulated: oneDNN's path is no gain
    assert resolve_layout("auto", "cpu", torch.bfloat16) == "row"
    monkeypatch.setattr(gemm_layout, "cpu_has_native_bf16", lambda: True)
    assert resolve_layout("auto", "cpu", torch.bfloat16) == ("packed" if packing_available() else "row")
    with pytest.raises(ValueError, match="unknown weight layout 'cols'; use one of: auto, row, column, packed"):
        resolve_layout("cols", "cpu", torch.float32)
    monkeypatch.setattr(gemm_layout, "packing_available", lambda dtype: False)
    with pytest.raises(ValueError, match="packed needs oneDNN packing of torch.float32 weights.*--weight-layout auto"):
        resolve_layout("packed", "cpu", torch.float32)
    for layout in ("packed", "measured"):
        with pytest.raises(ValueError, match=f"{layout} chooses CPU kernels; this model is on cuda"):
            resolve_layout(layout, "cuda", torch.bfloat16)


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
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-4, atol=1e-4)  # fp32 rounding through a whole model
    set_linear_layout(model, "row")
    assert linear_layout(model) == "row" and model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    with pytest.raises(ValueError, match="row, column, packed, transposed, measured, got 'auto'"):
        set_linear_layout(model, "auto")


def test_transposed_keeps_values_names_and_ties_and_computes_what_row_major_does():
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    logits = model(ids).logits
    assert resolve_layout("transposed", "cpu", torch.float32) == "transposed"
    set_linear_layout(model, "transposed")
    assert linear_layout(model) == "transposed" and isinstance(model.lm_head, PlannedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_contiguous()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-4, atol=1e-4)  # fp32 rounding through a whole model
    layer = copy.deepcopy(model.model.layers[0].mlp.up_proj)
    assert isinstance(layer, PlannedLinear) and layer.layout == "transposed"
    x = torch.randn(2, 3, layer.in_features)
    out = layer(x)
    assert out.shape == (2, 3, layer.out_features) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    biased = set_linear_layout(torch.nn.Linear(8, 5), "transposed")
    torch.testing.assert_close(biased(torch.ones(4, 8)),
                               torch.nn.functional.linear(torch.ones(4, 8), biased.weight, biased.bias))
    set_linear_layout(model, "row")
    assert linear_layout(model) == "row" and type(model.lm_head) is torch.nn.Linear


def test_load_target_applies_the_layout(tiny_model_dir):
    assert linear_layout(load_target(str(tiny_model_dir))[0]) == "row"  # training's default: as loaded
    assert linear_layout(load_target(str(tiny_model_dir), weight_layout="auto")[0]) == "measured"
    bf16_auto = linear_layout(load_target(str(tiny_model_dir), dtype="bf16", weight_layout="auto")[0])
    assert bf16_auto == ("packed" if gemm_layout.cpu_has_native_bf16() and packing_available() else "row")


needs_packing = pytest.mark.skipif(not packing_available(), reason="oneDNN packs no bf16 weights on this CPU")


@needs_packing
def test_packed_keeps_values_names_and_ties_and_computes_what_row_major_does():
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 1]])
    with torch.inference_mode():
        want = [model(ids[:, :n]).logits for n in (1, 3, 8)]  # one row, a few, a tree's worth
    set_linear_layout(model, "packed")
    assert linear_layout(model) == "packed" and isinstance(model.model.layers[0].mlp.up_proj, PlannedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tied parameter
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.inference_mode():
        for n, logits in zip((1, 3, 8), want):
            torch.testing.assert_close(model(ids[:, :n]).logits, logits)  # bf16's own tolerance
    clone = copy.deepcopy(model)  # the packed copies have no storage: the clone packs its own, at its first product
    assert linear_layout(clone) == "packed" and "packed_weight" not in vars(clone.lm_head)
    with torch.inference_mode():
        torch.testing.assert_close(clone(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert clone.lm_head.packed_weight is not model.lm_head.packed_weight
    set_linear_layout(model, "row")
    assert linear_layout(model) == "row" and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


@needs_packing
def test_packed_layers_take_the_plain_product_for_anything_but_bf16_inference_on_cpu():
    layer = set_linear_layout(torch.nn.Sequential(torch.nn.Linear(16, 8).to(torch.bfloat16)), "packed")[0]
    x = torch.randn(3, 16)
    assert isinstance(layer, PlannedLinear)
    fp32 = copy.deepcopy(layer).float()  # e.g. --fp32-head's copy of the LM head
    assert "packed_weight" not in fp32.__dict__  # no stale bf16 copy kept beside fp32 weights
    torch.testing.assert_close(fp32(x), torch.nn.functional.linear(x, fp32.weight, fp32.bias), rtol=0, atol=0)
    grad_x = x.to(torch.bfloat16).requires_grad_()
    layer(grad_x).sum().backward()  # training takes F.linear, which has a backward
    assert grad_x.grad is not None and grad_x.grad.shape == (3, 16)
    assert layer(torch.zeros(0, 16, dtype=torch.bfloat16)).shape == (0, 8)
    strided = torch.randn(2, 16, 3, dtype=torch.bfloat16).transpose(1, 2)  # [2, 3, 16], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(layer(strided), layer(strided.contiguous()), rtol=0, atol=0)
        torch.testing.assert_close(layer(strided), torch.nn.functional.linear(strided, layer.weight, layer.bias))


@needs_packing
def test_load_target_packs_bf16_on_request(tiny_model_dir):
    model = load_target(str(tiny_model_dir), dtype="bf16", weight_layout="packed")[0]
    assert linear_layout(model) == "packed"


@needs_packing
def test_plain_linears_runs_packed_and_transposed_layers_as_plain_ones_and_restores_them():
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval().to(torch.bfloat16)
    set_linear_layout(model, "packed")
    set_linear_layout(model.model.layers[1], "transposed")  # a mixed model: both come back
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        packed = model(ids).logits
        with gemm_layout.plain_linears(model):
            assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
            plain = model(ids).logits
    assert model.model.layers[0].mlp.up_proj.layout == "packed"
    assert model.model.layers[1].mlp.up_proj.layout == "transposed"
    torch.testing.assert_close(plain, packed)  # the same weights: products within bf16's own rounding


@pytest.mark.skipif(not packing_available(torch.float32), reason="oneDNN packs no fp32 weights on this CPU")
def test_every_kernel_a_plan_can_pick_computes_the_product_and_keeps_the_weights(monkeypatch):
    """Each plan the measurement can choose (every bucket on one kernel, and a mixed one) runs every row count, with
    and without a bias, to F.linear's product up to fp32 GEMM rounding; weights, names and ties are untouched."""
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 1, 4, 6]])
    mixed = ("packed", "transposed", "row", "packed", "transposed", "row", "packed")
    for plan in [(k,) * len(BUCKETS) for k in ("row", "transposed", "packed")] + [mixed]:
        monkeypatch.setattr(gemm_layout.gemm_choice, "plans", lambda shapes, dtype, p=plan: {s: p for s in shapes})
        model = AutoModelForCausalLM.from_config(config).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.inference_mode():
            want = [model(ids[:, :n]).logits for n in (1, 3, 10)]
            set_linear_layout(model, "measured")
            assert linear_layout(model) == "measured" and set(layout_plans(model).values()) == {plan}
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            for n, logits in zip((1, 3, 10), want):
                torch.testing.assert_close(model(ids[:, :n]).logits, logits, rtol=1e-4, atol=1e-4)  # fp32 rounding
            biased = set_linear_layout(torch.nn.Linear(8, 5), "measured")
            for rows in (1, 3, 70):
                x = torch.randn(rows, 8)
                torch.testing.assert_close(biased(x), torch.nn.functional.linear(x, biased.weight, biased.bias))
        assert ("packed_weight" in model.lm_head.__dict__) == ("packed" in plan)  # a copy only where a plan uses it


def test_a_packed_copy_is_made_at_the_first_product_that_needs_it_and_dropped_when_the_weight_moves(monkeypatch):
    if not packing_available(torch.float32):
        pytest.skip("oneDNN packs no fp32 weights on this CPU")
    monkeypatch.setattr(gemm_layout.gemm_choice, "plans",
                        lambda shapes, dtype: {s: ("packed",) * len(BUCKETS) for s in shapes})
    model = set_linear_layout(AutoModelForCausalLM.from_config(tiny_config("llama")).eval(), "measured")
    layer = model.model.layers[0].mlp.up_proj
    assert "packed_weight" not in layer.__dict__  # layers never called cost no memory
    x = torch.randn(2, layer.in_features)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, layer.weight)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
        assert "packed_weight" in layer.__dict__
        model.to(torch.float32)  # no change: the copy stays
        assert "packed_weight" in layer.__dict__
        model.to(torch.bfloat16)  # cast: the fp32 copy is stale and goes; bf16 packs its own where oneDNN can
        assert "packed_weight" not in layer.__dict__
        xb = x.to(torch.bfloat16)
        torch.testing.assert_close(layer(xb), torch.nn.functional.linear(xb, layer.weight))
        with torch.no_grad():
            layer.weight.data = torch.randn_like(layer.weight)  # a replaced weight is packed again
        torch.testing.assert_close(layer(xb), torch.nn.functional.linear(xb, layer.weight))


def test_a_traceable_product_runs_the_layers_own_kernels_and_plain_f_linear_for_anything_else(monkeypatch):
    """`specheads::planned_linear` runs the layer registered for it (its plan, its packed copy) when given that
    layer's own weight, and F.linear for any other weight (a copy a compiler made); a layer without a plan traces as
    F.linear."""
    plan = ("packed" if packing_available(torch.float32) else "transposed",) * len(BUCKETS)
    monkeypatch.setattr(gemm_layout.gemm_choice, "plans", lambda shapes, dtype: {s: plan for s in shapes})
    layer = set_linear_layout(torch.nn.Linear(16, 24), "measured")
    product = gemm_layout.traceable_product(layer)
    slot = layer.traced_slot
    gemm_layout.traceable_product(layer)
    assert layer.traced_slot == slot  # one slot per layer, however many graphs trace it
    calls = []
    forward = PlannedLinear.forward
    monkeypatch.setattr(PlannedLinear, "forward", lambda self, x: calls.append(self) or forward(self, x))
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, 16)
            assert torch.equal(product(x, layer.weight, layer.bias), forward(layer, x))  # the same kernel: bitwise
            copy_ = layer.weight.clone()
            assert torch.equal(product(x, copy_, layer.bias), torch.nn.functional.linear(x, copy_, layer.bias))
    assert calls == [layer, layer]  # the layer's own weight only
    clone = copy.deepcopy(layer)  # a deep copy has a weight of its own, so a slot of its own
    gemm_layout.traceable_product(clone)
    assert clone.traced_slot != layer.traced_slot
    assert gemm_layout.traceable_product(torch.nn.Linear(16, 24)) is torch.nn.functional.linear

import pytest
import torch
from torch import nn

from specheads import int8
from specheads.int8 import Int8Linear, Int8Matrix, quantize_linears


def test_int8_linear_is_close_to_the_fp32_one():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 64)
    got, want = Int8Linear(linear)(x), linear(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # 8-bit weights and activations
    assert not torch.equal(got, want)  # it really is quantised
    assert Int8Linear(linear)(x.to(torch.bfloat16)).dtype == torch.bfloat16  # a bf16 drafter stays bf16


def test_quantize_linears_replaces_every_linear_inside():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)))
    x = torch.randn(3, 8)
    want = model(x)
    quantize_linears(model)
    assert [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))] == ["Int8Linear"] * 2
    torch.testing.assert_close(model(x), want, atol=0.1, rtol=0.1)


def test_without_int8_kernels_the_error_names_the_way_out(monkeypatch):
    monkeypatch.setattr(int8, "int8_supported", lambda: False)
    with pytest.raises(ValueError, match="no int8 CPU kernels .* leave --draft-dtype at its default"):
        Int8Matrix(torch.randn(4, 4))


def test_int8_medusa_heads_leave_the_shared_target_lm_head_alone():
    from specheads.heads.medusa import MedusaConfig, MedusaHeads
    from tests.conftest import tiny_model

    target = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=2), target.get_output_embeddings())
    assert heads.target_lm_head is target.lm_head  # the shared full-vocabulary head
    hidden = torch.randn(1, 3, target.config.hidden_size)
    want = heads(hidden)
    quantize_linears(heads)
    assert type(target.lm_head) is nn.Linear and isinstance(heads.target_lm_head, Int8Linear)
    got = heads(hidden)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_an_int8_early_exit_draft_of_a_bf16_target_leaves_the_target_alone():
    from specheads.inference.methods import METHODS, make_proposer
    from tests.conftest import tiny_model

    target = tiny_model("llama").to(torch.bfloat16)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    proposer = make_proposer("draft", target, METHODS.get("draft").make_options(
        {"draft": "early-exit:1", "draft_dtype": "int8"}), None)
    draft = proposer.model
    assert isinstance(draft.lm_head, Int8Linear) and isinstance(draft.model.layers[0].mlp.up_proj, Int8Linear)
    assert draft.model.embed_tokens.weight.dtype == torch.float32  # what int8 products return
    assert isinstance(target.lm_head, nn.Linear) and isinstance(target.model.layers[0].mlp.up_proj, nn.Linear)
    after = target.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v) for k, v in before.items())

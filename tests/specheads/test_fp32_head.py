"""--fp32-head: a bf16 target's final norm and LM head run in fp32 on its bf16 residual stream, and drafters that
share its LM head keep working."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from specheads.fp32_head import Fp32Output, fp32_head
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from tests.conftest import repetitive_prompt, tiny_model
from tests.drafters import proposer_for, save_case


def bf16_pair():
    fp32 = tiny_model("llama")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    return fp32, bf16, fp32_head(copy.deepcopy(bf16))


def test_logits_come_from_the_bf16_residual_stream_through_an_fp32_norm_and_head():
    _, bf16, head = bf16_pair()
    ids = torch.tensor([repetitive_prompt()])
    seen = []
    head.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    logits = head(ids).logits
    residual = seen[0]  # [1, T, H] what the last decoder layer returned, in bf16
    assert residual.dtype == torch.bfloat16 and logits.dtype == torch.float32
    norm32 = copy.deepcopy(bf16.model.norm).float()
    want = torch.nn.functional.linear(norm32(residual.float()), bf16.lm_head.weight.float())
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # bf16 logits differ from these by their own rounding (what --fp32-head removes) at least
    assert not torch.equal(bf16(ids).logits.float(), logits)
    # The decoder stays bf16; the LM head's rows and the tied embedding are left as they were.
    assert head.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert isinstance(head.lm_head, Fp32Output) and head.lm_head.weight.dtype == torch.bfloat16
    assert head.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_drafters_sharing_the_lm_head_decode_like_ar_on_it(kind, tmp_path):
    _, _, target = bf16_pair()
    save_case(kind, target, tmp_path / kind)
    prompt = repetitive_prompt()
    ar = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    res = Engine(target, proposer_for(kind, target, tmp_path / kind, {"lookup": 0})).generate(prompt, max_new_tokens=24)
    assert res.stats.drafted > 0 and res.stats.new_tokens == 24
    assert res.output_ids == ar.output_ids  # no near-tie on this prompt: the fp32 head decides alike in both


def test_fp32_models_are_left_alone_and_unsupported_ones_refused():
    model = tiny_model("llama")
    assert fp32_head(model) is model and isinstance(model.lm_head, torch.nn.Linear)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                       vocab_size=50)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="--fp32-head needs a decoder with a final `norm`.*leave --fp32-head off"):
        fp32_head(gpt2)

"""The family matrix: every drafter kind, n-gram lookup and a draft model decode each decoder family's tiny target
exactly as the target's own forward would (greedy, past the sliding windows), with drafts accepted; heads of
families whose layers do not fit a head get Llama layers of the target's sizes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from specheads.draft_layers import draft_layer_classes, final_norm_scale, source_layer_config
from specheads.hf import decoder_of
from specheads.inference.engine.engine import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from tests.conftest import perturbed_copy, repetitive_prompt, tiny_model
from tests.drafters import DRAFTERS, proposer_for, save_case

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral-window", "gemma2", "gemma3_text", "gpt_oss", "phi3",
            "granite", "olmo2", "exaone4"]
MIRRORED = {"llama", "qwen2", "qwen3", "mistral-window"}  # heads copy these targets' own layers
PROMPT = repetitive_prompt(24, seed=1)
NEW = 30


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param)
    ids = list(PROMPT)
    with torch.inference_mode():  # the target's own forward over the whole sequence, its own masks
        for _ in range(NEW):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return request.param, model, ids[len(PROMPT):]


@pytest.mark.parametrize("method", ["ngram", "draft", *DRAFTERS])
def test_every_method_decodes_every_family_as_its_own_forward(family, method, tmp_path):
    arch, model, want = family
    if method == "draft":
        proposer = DraftModelProposer(perturbed_copy(model, 0.02))
    elif method == "ngram":
        proposer = make_proposer(method, model, METHODS.get(method).make_options({}), None)
    else:
        save_case(method, model, tmp_path)
        proposer = proposer_for(method, model, tmp_path, {"lookup": 0})
    out = Engine(model, proposer).generate(PROMPT, max_new_tokens=NEW)
    assert out.output_ids == want, (arch, method)
    if method != "ngram":
        assert out.stats.drafted > 0, (arch, method)


def test_heads_copy_llama_family_layers_and_build_llama_layers_for_the_others(family):
    arch, model, _ = family
    classes = draft_layer_classes(model)
    assert classes.mirrored == (arch in MIRRORED)
    if classes.mirrored:
        assert classes.layer is type(decoder_of(model).layers[0])
        return
    assert classes.layer is LlamaDecoderLayer
    text = model.config.get_text_config()
    layers = source_layer_config(text)
    assert (layers.hidden_size, layers.num_attention_heads, layers.intermediate_size) == (
        text.hidden_size, text.num_attention_heads, text.intermediate_size)
    # a Llama final norm starts as the scale the target's own applies (Gemma's 1 + w included)
    row = torch.randn(3, text.hidden_size)
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + text.rms_norm_eps)
    torch.testing.assert_close(normed * final_norm_scale(model), decoder_of(model).norm(row), atol=1e-4, rtol=1e-4)

"""The family matrix: every drafter kind, n-gram lookup and a draft model decode each decoder family's tiny target
exactly as the target's own forward would (greedy, past the sliding windows), with drafts accepted; heads of
families whose layers do not fit a head get Llama layers of the target's sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from specheads.draft_layers import draft_layer_classes, final_norm_scale, source_layer_config
from specheads.hf import decoder_of
from specheads.inference.engine.engine import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from specheads.train.objective import OBJECTIVES
from tests.conftest import perturbed_copy, repetitive_prompt, tiny_config, tiny_model
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


def test_the_targets_table_is_the_suites_matrix():
    lines = (Path(__file__).parents[1] / "docs" / "targets.md").read_text().splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| `")]
    documented = {cells[0].strip().split("`")[1] for cells in rows}
    assert documented == {tiny_config(arch).model_type for arch in FAMILIES}
    assert all(cells[-1].strip() == "yes" for cells in rows)
    assert {cells[0].strip().split("`")[1] for cells in rows if cells[2].strip() == "the target's"} == {
        tiny_config(arch).model_type for arch in MIRRORED}
    header = next(line for line in lines if line.startswith("| family")).split("|")
    assert header[-2].split(":")[1].replace(" ", "").split(",") == ["n-gram", "draftmodel", *DRAFTERS]
    assert header[-3].split(":")[1].replace(" ", "").split(",") == list(RECIPES)
    assert all(cells[-2].strip() == "yes" for cells in rows)


RECIPES = {"eagle": {}, "eagle3": {"aux_layers": (1, 2, 3)}, "peagle": {"aux_layers": (1, 2, 3)},
           "dflash": {"aux_layers": (1, 2, 3)}, "medusa": {}}


def answers(n: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    """A batch of sequences counting up by 3 after a random start (a learnable pattern), loss on all but the
    first 4 tokens."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(3, 60, (n, 1), generator=g)
    ids = (starts + 3 * torch.arange(length)) % 93 + 3
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_on_every_family(family, recipe):
    # the recipe's own build and step loss (online features from the target), a few AdamW steps on one batch
    arch, model, _ = family
    objective = OBJECTIVES.get(recipe)
    settings = objective.settings(**RECIPES[recipe])
    torch.manual_seed(0)
    head = objective.build(settings, model, list(range(3, 90)))
    optimizer = torch.optim.AdamW(objective.param_groups(head, 3e-3, settings), lr=3e-3)
    batch, losses = answers(), []
    for _ in range(8):
        loss, stats = objective.step_loss(head, model, batch, settings)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        assert "top1" in stats
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (arch, recipe, losses)

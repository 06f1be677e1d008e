"""Sliding-window and hybrid targets (Mistral with a window, Gemma 2, Gemma 3, gpt-oss, EXAONE 4) decode exactly: the
engine's full-length caches with the window applied in the mask, per layer type, give the tokens the model's own
forward gives, drafts accepted or not, one row or several, greedy or sampled; and layer kinds a tree cannot branch
are refused."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from transformers import LlamaConfig

import specheads.inference.engine.engine as engine_mod
import specheads.inference.engine.target_backend as target_backend_mod
from specheads.inference.engine.batch_cache import batch_tree_mask, causal_mask
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.layer_attention import FULL, FULL_ONLY, SLIDING, LayerAttention, layer_attention
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from tests.conftest import WINDOW, perturbed_copy, repetitive_prompt, tiny_config, tiny_model
from tests.drafters import (
    COUNTING_PROMPT,
    PARAMS,
    SAMPLES,
    _verify_keeping_a_rejected_draft,
    chi_square_p,
    exact_two_token_law,
    first_two_tokens,
)

WINDOWED = ["mistral-window", "gemma2", "gemma3_text", "gpt_oss", "exaone4"]
PROMPT = repetitive_prompt(24, seed=1)
NEW = 40  # decodes far past the window of WINDOW tokens


def own_greedy(model, prompt: list[int], new: int) -> list[int]:
    """The model's own forward over the whole sequence at every step (no cache): transformers' own masks."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request):
    model = tiny_model(request.param)
    return request.param, model, own_greedy(model, PROMPT, NEW)


def test_layer_types_and_windows_are_read_from_the_config():
    assert layer_attention(tiny_config("llama")) == FULL_ONLY and not FULL_ONLY.windowed
    assert layer_attention(tiny_config("mistral-window")).windows == ((SLIDING, WINDOW),)
    assert layer_attention(tiny_config("gemma3_text")).windows == ((SLIDING, WINDOW), (FULL, None))
    assert layer_attention(tiny_config("exaone4")).windowed


@pytest.mark.parametrize(("layer_types", "message"), [
    (["full_attention", "linear_attention"], "llama has linear_attention layers, whose state a draft tree cannot"),
    (["sliding_attention"] * 2, "sets no sliding_window; set it to the window the model was trained with"),
])
def test_layers_a_tree_cannot_branch_are_refused_by_name(layer_types, message):
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = layer_types
    with pytest.raises(ValueError, match=message):
        layer_attention(config)


def test_the_window_counts_positions_not_slots():
    # A node at depth 2 on a prefix of 10 sits at position 12: with a window of 4 it sees positions 9..12, i.e.
    # prefix slot 9, its parent (depth 1, position 11) and itself, but not slots 0..8, and never its sibling.
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, 0, 1]))
    attention = LayerAttention(((SLIDING, 4), (FULL, None)))
    masks = batch_tree_mask([tree], [10], torch.float32, torch.device("cpu"), attention=attention)
    local, full = (masks[kind][0, 0] == 0 for kind in (SLIDING, FULL))
    assert local[3].nonzero().flatten().tolist() == [9, 10, 11, 13]  # slot 10 + j holds node j
    assert full[3].nonzero().flatten().tolist() == list(range(10)) + [10, 11, 13]
    chain = causal_mask([3], 4, 7, torch.float32, torch.device("cpu"), LayerAttention(((SLIDING, 2),)))[0, 0] == 0
    assert [row.nonzero().flatten().tolist() for row in chain] == [[2, 3], [3, 4], [4, 5], [5, 6]]


@pytest.mark.parametrize("method", ["ar", "ngram", "draft"])
def test_windowed_targets_decode_as_their_own_forward(windowed, method):
    arch, model, want = windowed
    proposer = (DraftModelProposer(perturbed_copy(model, 0.02)) if method == "draft"
                else make_proposer(method, model, METHODS.get(method).make_options({}), None))
    out = Engine(model, proposer).generate(PROMPT, max_new_tokens=NEW)
    assert out.output_ids == want, arch
    if method == "draft":  # drafts were accepted: tree verification crossed the window, not only plain steps
        assert out.stats.steps < NEW / 2, out.stats


ROWS = [(repetitive_prompt(n, seed), new) for seed, n, new in ((2, 9, 30), (3, 30, 12), (4, 17, 25))]


def decode_rows(model) -> list[list[int]]:
    """Three prompts in one engine (a batch of rows: every verify forward takes the engine's masks)."""
    engine = Engine(model, DraftModelProposer(perturbed_copy(model, 0.02)), max_rows=3)
    seqs = [engine.add(prompt, max_new_tokens=new) for prompt, new in ROWS]
    while any(not s.done for s in seqs):
        engine.step()
    return [s.output for s in seqs]


def test_windowed_rows_decode_together_as_each_alone(windowed):
    arch, model, _ = windowed
    assert decode_rows(model) == [own_greedy(model, prompt, new) for prompt, new in ROWS], arch


def test_without_the_window_in_the_mask_rows_part_from_the_models_own(windowed, monkeypatch):
    # The negative control: the same batch with every layer's mask full parts from the model's own tokens, so the
    # test above would see a window the engine failed to apply.
    arch, model, _ = windowed
    monkeypatch.setattr(target_backend_mod, "layer_attention", lambda config: FULL_ONLY)
    assert decode_rows(model) != [own_greedy(model, prompt, new) for prompt, new in ROWS], arch


def test_sampling_windowed_rows_keeps_the_targets_law(windowed):
    # Rows sampled together with draft-model trees past the window: the first two tokens follow the target's exact
    # law (from its own forward); a verifier that keeps a rejected draft fails the same test (the sample has power).
    arch, model, _ = windowed
    # a draft far enough from the target that rejections are common (what the negative control needs)
    engine = Engine(model, DraftModelProposer(perturbed_copy(model, 0.15)), max_rows=3)
    law = exact_two_token_law(model, COUNTING_PROMPT, PARAMS)
    counts, accepted = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, SAMPLES)
    assert accepted > SAMPLES // 10 and chi_square_p(counts, law) > 1e-3, (arch, accepted, counts)
    with patch.object(engine_mod, "verify", _verify_keeping_a_rejected_draft):
        broken, _ = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, SAMPLES)
    assert chi_square_p(broken, law) < 1e-6, (arch, broken)

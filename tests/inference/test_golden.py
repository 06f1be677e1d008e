"""Golden equivalence: every method's greedy output equals plain greedy decoding of the same model."""

from __future__ import annotations

import pytest
import torch

from specheads.draft_models import early_exit_model
from specheads.inference import Engine, SamplingParams
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.methods.options import LookaheadConfig, SuffixConfig
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer
from specheads.inference.proposers.lookahead import LookaheadProposer
from specheads.inference.proposers.ngram import NgramConfig, NgramProposer
from specheads.inference.proposers.suffix import SuffixProposer
from tests.conftest import perturbed_copy, repetitive_prompt

MAX_NEW = 40


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def proposers(target, arch):
    yield "ngram", NgramProposer(NgramConfig(min_ngram=1))  # random tiny models rarely repeat 2-grams
    yield "ngram-wide", NgramProposer(NgramConfig(num_candidates=5, depth=6, max_nodes=20, min_ngram=1))
    yield "suffix", SuffixProposer(SuffixConfig())
    yield "lookahead", LookaheadProposer(LookaheadConfig())
    yield "lookahead-every-step", LookaheadProposer(LookaheadConfig(window=5, ngram=4, candidates=4, lazy_window=False))
    draft = perturbed_copy(target, noise=0.05)
    yield "draft-chain", DraftModelProposer(draft, DraftConfig(depth=4), target_vocab_size=96)
    yield "draft-tree", DraftModelProposer(draft, DraftConfig(depth=3, width=3), target_vocab_size=96)
    yield "early-exit", DraftModelProposer(early_exit_model(target, 2), DraftConfig(depth=4, width=2))
    yield "early-exit-int8", make_proposer("draft", target, METHODS.get("draft").make_options(
        {"draft": "early-exit:2", "depth": 4, "width": 2, "draft_dtype": "int8"}), None)


@pytest.mark.parametrize("prompt_seed", [1, 2])
def test_every_method_matches_plain_greedy(target, arch, prompt_seed):
    prompt = repetitive_prompt(seed=prompt_seed)
    reference = hf_greedy(target, prompt, MAX_NEW)
    ar = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW)
    assert ar.output_ids == reference
    assert ar.stats.steps == MAX_NEW and ar.stats.tau == 1.0
    for name, proposer in proposers(target, arch):
        res = Engine(target, proposer).generate(prompt, max_new_tokens=MAX_NEW, sampling=SamplingParams())
        assert res.output_ids == reference, name
        assert res.stats.new_tokens == MAX_NEW
        assert res.stats.drafted > 0, name
        assert res.stats.new_tokens <= res.stats.steps + res.stats.accepted, name
        if name.startswith(("draft", "early")):
            # Multi-token accepted paths exercise the cache's gather-and-truncate commit on both models.
            assert len(res.stats.accept_per_position) >= 2, (name, res.stats.to_dict())


def test_early_exit_shares_weights_and_matches_truncated_forward(target):
    draft = early_exit_model(target, 2)
    assert (draft.model.layers[0].self_attn.q_proj.weight.data_ptr()
            == target.model.layers[0].self_attn.q_proj.weight.data_ptr())
    assert len(draft.model.layers) == 2
    ids = torch.tensor([repetitive_prompt()])
    hidden = target(ids, output_hidden_states=True).hidden_states[2]
    expected = target.lm_head(target.model.norm(hidden))
    torch.testing.assert_close(draft(ids).logits, expected)


def test_stop_token_ends_generation(target):
    prompt = repetitive_prompt()
    reference = hf_greedy(target, prompt, MAX_NEW)
    stop = reference[5]
    first = reference.index(stop)
    for proposer in (AutoregressiveProposer(), NgramProposer()):
        res = Engine(target, proposer).generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=[stop])
        assert res.output_ids == reference[: first + 1]
        assert res.stats.finish_reason == "stop"

"""The draft vocabulary grown by the request's tokens: scores the right rows, and lets EAGLE heads draft
prompt tokens outside their draft vocabulary without changing the output."""

from __future__ import annotations

import torch

from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.context_vocab import ContextVocabulary
from specheads.inference.proposers.eagle import EagleProposer
from tests.conftest import TINY_VOCAB, random_eagle_head, start_proposer, tiny_model

DRAFT_IDS = list(range(3, 19))  # 16 tokens; the prompts below use others


def test_scores_the_draft_rows_then_the_request_tokens_in_order_of_arrival():
    weight = torch.randn(TINY_VOCAB, 8)
    vocab = ContextVocabulary(weight, torch.tensor(DRAFT_IDS))
    vocab.reset(torch.tensor([40, 5, 41, 40]))  # 5 is in the draft vocabulary already
    vocab.add(torch.tensor([41, 50]))
    ids = DRAFT_IDS + [40, 41, 50]
    assert vocab.size == len(ids)
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(vocab.logits(hidden), hidden @ weight[ids].T)
    assert vocab.token_ids(torch.arange(len(ids))).tolist() == ids
    vocab.reset(torch.tensor([60]))  # a new request forgets the last one's tokens
    assert vocab.token_ids(torch.arange(vocab.size)).tolist() == DRAFT_IDS + [60]


def test_disabled_or_full_vocabulary_scores_a_fixed_set():
    weight = torch.randn(TINY_VOCAB, 8)
    off = ContextVocabulary(weight, torch.tensor(DRAFT_IDS), enabled=False)
    off.reset(torch.tensor([40, 41]))
    assert off.size == len(DRAFT_IDS)
    full = ContextVocabulary(weight, None)
    full.reset(torch.tensor([40, 41]))
    assert full.size == TINY_VOCAB
    hidden = torch.randn(2, 8)
    torch.testing.assert_close(full.logits(hidden), hidden @ weight.T)
    assert torch.equal(full.token_ids(torch.tensor([7, 40])), torch.tensor([7, 40]))


def _drafted_tokens(proposer: EagleProposer, target, prompt: list[int]) -> set[int]:
    return set(proposer.propose(start_proposer(proposer, target, prompt, max_depth=4)).tokens[1:].tolist())


def test_eagle_heads_draft_prompt_tokens_only_with_the_context_vocabulary():
    target = tiny_model("llama")
    head = random_eagle_head(target, aux_layers=(), draft_vocab=tuple(DRAFT_IDS))
    prompt = list(range(40, 64))
    with_context = _drafted_tokens(EagleProposer(head, context_vocab=True), target, prompt)
    without = _drafted_tokens(EagleProposer(head, context_vocab=False), target, prompt)
    assert without <= set(DRAFT_IDS)
    assert with_context <= set(DRAFT_IDS) | set(prompt)
    assert with_context & set(prompt), with_context  # random heads favour no row, so some prompt tokens win

    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24).output_ids
    for flag in (True, False):
        assert (Engine(target, EagleProposer(head, context_vocab=flag)).generate(prompt, max_new_tokens=24).output_ids
                == plain)

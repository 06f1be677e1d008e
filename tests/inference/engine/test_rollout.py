"""Rollouts: prompts decoded together with a drafter give each prompt's plain greedy output, and every recorded step
says truly where its draft failed (checked against the draft model's own teacher-forced choices)."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.rollout import rollout
from specheads.inference.methods.draft import DraftConfig
from specheads.inference.proposers.draft_model import DraftModelProposer
from tests.conftest import perturbed_copy, repetitive_prompt, tiny_model

PROMPTS = [repetitive_prompt(length, seed) for seed, length in enumerate((20, 9, 15, 26, 12), start=1)]
DEPTH = 3


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def test_rollouts_are_plain_greedy_and_their_steps_say_where_drafts_failed(target):
    draft = perturbed_copy(target, 0.05)  # right often, wrong often enough
    outs = rollout(target, DraftModelProposer(draft, DraftConfig(depth=DEPTH)), PROMPTS, max_new_tokens=24, rows=3)
    plain = Engine(target, AutoregressiveProposer())
    failures = 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        assert out.output == plain.generate(prompt, max_new_tokens=24).output_ids  # exact
        assert [s.accepted for s in out.steps] and sum(s.accepted for s in out.steps) == out.stats.accepted
        assert len(out.steps) == out.stats.draft_steps
        # the draft model's choice at each output index, given the text before it (teacher forced: what it drafts
        # there while its earlier drafts of the step were accepted)
        text = torch.tensor([prompt + out.output])
        choice = draft(text).logits[0].argmax(-1)[len(prompt) - 1 : -1].tolist()  # [i]: its token for output[i]
        end = 0
        for step in out.steps:
            assert step.start >= end  # steps in order, none overlapping the one before
            assert 1 <= step.drafted <= DEPTH
            right = [choice[i] == out.output[i] for i in range(step.start, step.start + step.accepted)]
            assert all(right)
            if step.rejected:
                assert step.accepted < step.drafted
                assert choice[step.start + step.accepted] != out.output[step.start + step.accepted]
            else:
                assert step.accepted == step.drafted
            end = step.start + step.accepted + 1
        assert out.failures() == [s.start + s.accepted for s in out.steps if s.rejected]
        failures += len(out.failures())
    assert failures > 0  # the check above has something to check


def test_a_drafter_that_is_the_target_never_fails(target):
    outs = rollout(target, DraftModelProposer(target, DraftConfig(depth=DEPTH)), PROMPTS[:3], max_new_tokens=16,
                   rows=2)
    assert all(not out.failures() for out in outs)
    assert all(step.accepted == step.drafted for out in outs for step in out.steps)


def test_sampled_rollouts_draw_as_each_prompt_alone_with_its_seed(target):
    from specheads.inference.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0, seed=7)
    outs = rollout(target, DraftModelProposer(perturbed_copy(target, 0.05), DraftConfig(depth=DEPTH)), PROMPTS[:3],
                   max_new_tokens=12, sampling=sampling, rows=3)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        alone = Engine(target, DraftModelProposer(perturbed_copy(target, 0.05), DraftConfig(depth=DEPTH)))
        assert out.output == alone.generate(prompt, max_new_tokens=12, sampling=sampling.for_draw(i)).output_ids

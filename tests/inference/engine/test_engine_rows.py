"""Several sequences in one engine: each row's greedy output equals its own plain greedy output whatever else is in
the batch (mixed prompt lengths, rows joining and leaving between steps, every drafter kind, n-gram lookup and a
draft model), and sampled rows keep the target's law (every drafter kind and n-gram lookup)."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from tests.conftest import perturbed_copy, repetitive_prompt
from tests.drafters import (
    COUNTING_PROMPT,
    DRAFTERS,
    PARAMS,
    bigram_target,
    check_sampling_preserves_the_target_distribution,
    chi_square_p,
    exact_two_token_law,
    first_two_tokens,
    proposer_for,
    save_case,
)

PROMPTS = [repetitive_prompt(length, seed) for seed, length in enumerate((24, 9, 17, 30, 12, 21), start=1)]
MAX_NEW = [30, 12, 25, 8, 20, 16]  # rows finish at different steps, so others move rows and newcomers join


def decode_together(engine: Engine, prompts=PROMPTS, max_new=MAX_NEW, sampling=SamplingParams()) -> list[list[int]]:
    seqs = [engine.add(p, max_new_tokens=m, sampling=sampling) for p, m in zip(prompts, max_new)]
    most = 0
    while any(not s.done for s in seqs):
        engine.step()
        most = max(most, engine.num_running)
    assert most == engine.max_rows  # the batch filled up
    assert engine.num_running == engine.num_waiting == 0
    return [s.output for s in seqs]


def alone(target, prompts=PROMPTS, max_new=MAX_NEW) -> list[list[int]]:
    engine = Engine(target, AutoregressiveProposer())
    return [engine.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, max_new)]


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix", "lookahead", "draft"])
def test_rows_decode_greedily_as_each_would_alone(target, method):
    if method == "draft":
        proposer = DraftModelProposer(perturbed_copy(target, 0.02))
    else:
        proposer = make_proposer(method, target, METHODS.get(method).make_options({}), None)
    engine = Engine(target, proposer, max_rows=3)
    together = decode_together(engine)
    assert together == alone(target)
    # the engine is reusable: a second batch, now through a warm cache with stale entries in every row
    assert decode_together(engine, PROMPTS[::-1], MAX_NEW[::-1]) == alone(target, PROMPTS[::-1], MAX_NEW[::-1])


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_every_drafter_kind_decodes_exactly_in_a_batch(kind, target, tmp_path):
    save_case(kind, target, tmp_path)
    engine = Engine(target, proposer_for(kind, target, tmp_path, {}), max_rows=4)
    assert decode_together(engine) == alone(target)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_rows_draft_what_each_drafts_alone(kind, target, tmp_path):
    """Each row's proposer keeps its own state (a wrapped proposer, a request vocabulary): with whole trees verified,
    every row drafts and accepts in a batch exactly what it does alone. State shared between rows would change the
    drafts, never the output, so only these counts show it."""
    save_case(kind, target, tmp_path)
    options = {"node_budget": "fixed"} if METHODS.get(kind).takes("node_budget") else {}
    engine = Engine(target, proposer_for(kind, target, tmp_path, options), max_rows=4)
    seqs = [engine.add(p, max_new_tokens=m) for p, m in zip(PROMPTS, MAX_NEW)]
    while any(not s.done for s in seqs):
        engine.step()
    single = Engine(target, proposer_for(kind, target, tmp_path, options))
    for seq, prompt, most in zip(seqs, PROMPTS, MAX_NEW):
        stats = single.generate(prompt, max_new_tokens=most).stats
        assert (seq.stats.steps, seq.stats.drafted, seq.stats.accepted) == (stats.steps, stats.drafted, stats.accepted)
        assert stats.drafted > 0


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_sampled_rows_keep_the_targets_law(kind, tmp_path):
    """The check every kind passes alone (tests/drafters.py: chi-square of the first two sampled tokens, and a
    verifier that keeps a rejected draft caught by it), with the generations decoded 4 at a time."""
    check_sampling_preserves_the_target_distribution(kind, tmp_path, rows=4)


@pytest.mark.usefixtures("one_thread")
def test_sampled_ngram_rows_keep_the_targets_law():
    target = bigram_target()
    engine = Engine(target, make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None), max_rows=4)
    counts, accepted = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, 400)
    assert accepted > 100  # drafts were accepted: the rows speculated
    assert chi_square_p(counts, exact_two_token_law(target, COUNTING_PROMPT, PARAMS)) > 1e-3, counts


def test_generate_refuses_to_run_beside_sequences_in_flight(target):
    engine = Engine(target, AutoregressiveProposer(), max_rows=2)
    engine.add(PROMPTS[0], max_new_tokens=4)
    with pytest.raises(RuntimeError, match="generate decodes alone"):
        engine.generate(PROMPTS[1], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        Engine(target, AutoregressiveProposer(), max_rows=0)
    assert torch.is_tensor(engine.add(PROMPTS[1], max_new_tokens=2).tokens)


class _BatchRecorder(AutoregressiveProposer):
    """Drafts nothing; records the batch size each draft request names, by step (forks share the record)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []  # per engine step: ctx.batch of each draft request

    def propose(self, ctx):
        self.seen[-1].append(ctx.batch)
        return super().propose(ctx)


def test_a_draft_request_names_the_batch_it_verifies_in(target):
    proposer = _BatchRecorder()
    engine = Engine(target, proposer, max_rows=3)
    seqs = [engine.add(p, max_new_tokens=m) for p, m in zip(PROMPTS[:4], MAX_NEW[:4])]
    while any(not s.done for s in seqs):
        proposer.seen.append([])
        verifying = engine.num_running  # rows prefilled in earlier steps: this step drafts for them
        engine.step()
        # every row drafts but one with a single token left to go (nothing to draft before its bonus token)
        assert proposer.seen[-1] == [verifying] * len(proposer.seen[-1]) and len(proposer.seen[-1]) <= verifying
    assert {len(step) and step[0] for step in proposer.seen} == {0, 1, 2, 3}  # the prefill, rows leaving and joining

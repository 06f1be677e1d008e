"""Proposer failures under a fallback handler cost plain steps, never exactness: whatever a row's proposer does wrong
(raises in propose, start or on_verified, drafts a tree the target cannot verify, fails inside a batched draft), the
output equals plain greedy decoding, every failure is counted and reported, and without a handler it propagates."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.fallback import FallbackProposer
from specheads.inference.engine.proposer import AutoregressiveProposer, fork
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods import METHODS, make_proposer
from tests.conftest import repetitive_prompt

PROMPTS = [repetitive_prompt(length, seed) for seed, length in enumerate((24, 9, 17, 30), start=1)]
MAX_NEW = 20


def ngram(target):
    return make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None)


class Faulty:
    """n-gram lookup that fails where told: `propose` raises on calls divisible by `raise_every`, returns a tree with
    the wrong root on calls divisible by `bad_root_every`, or an out-of-vocabulary token on those divisible by
    `bad_token_every`; `start` and `on_verified` raise when `bad_start` / `bad_verified` is set."""

    def __init__(self, inner, *, raise_every=0, bad_root_every=0, bad_token_every=0, bad_start=False,
                 bad_verified=False) -> None:
        self.inner = inner
        self.needs_target_hidden = inner.needs_target_hidden
        self.raise_every, self.bad_root_every, self.bad_token_every = raise_every, bad_root_every, bad_token_every
        self.bad_start, self.bad_verified = bad_start, bad_verified
        self.calls = 0

    def start(self, ctx, hidden):
        if self.bad_start:
            raise RuntimeError("could not start")
        self.inner.start(ctx, hidden)

    def on_verified(self, result, hidden):
        self.inner.on_verified(result, hidden)
        if self.bad_verified:
            raise RuntimeError("lost track")

    def propose(self, ctx):
        self.calls += 1
        if self.raise_every and self.calls % self.raise_every == 0:
            raise RuntimeError("drafter crashed")
        if self.bad_root_every and self.calls % self.bad_root_every == 0:
            return DraftTree.chain(torch.tensor([int(ctx.tokens[-1]) + 1, 5]))
        if self.bad_token_every and self.calls % self.bad_token_every == 0:
            return DraftTree.chain(torch.tensor([int(ctx.tokens[-1]), 10**6]))
        return self.inner.propose(ctx)


def plain(target, prompt):
    return Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids


class Reports(list):
    def __call__(self, reason, err):
        self.append((reason, str(err)))


@pytest.mark.parametrize("faults, reasons", [
    (dict(raise_every=2), {"proposer_error"}),
    (dict(bad_root_every=2), {"malformed_tree"}),
    (dict(bad_token_every=3), {"malformed_tree"}),
    (dict(bad_start=True), {"proposer_error"}),
    (dict(bad_verified=True), {"proposer_error"}),
])
def test_a_failing_proposer_costs_plain_steps_and_the_output_stays_exact(target, faults, reasons):
    reports = Reports()
    prompt = PROMPTS[0]
    engine = Engine(target, Faulty(ngram(target), **faults), fallback=reports)
    result = engine.generate(prompt, max_new_tokens=MAX_NEW)
    assert result.output_ids == plain(target, prompt)
    assert {reason for reason, _ in reports} == reasons
    assert result.stats.fallbacks == len(reports) > 0


def test_without_a_handler_a_proposer_error_propagates(target):
    engine = Engine(target, Faulty(ngram(target), raise_every=1))
    with pytest.raises(RuntimeError, match="drafter crashed"):
        engine.generate(PROMPTS[0], max_new_tokens=MAX_NEW)


class Batched:
    """Drafts its rows together (a static `propose_many`, as heads do); the batched call fails whenever a poisoned
    row is in it, and a poisoned row fails alone too, so only it may fall back."""

    needs_target_hidden = False
    batched_calls = forks = 0

    def __init__(self, inner, poisoned: bool = False) -> None:
        self.inner, self.poisoned = inner, poisoned

    def start(self, ctx, hidden):
        self.inner.start(ctx, hidden)

    def on_verified(self, result, hidden):
        self.inner.on_verified(result, hidden)

    def fork(self):
        Batched.forks += 1
        return Batched(fork(self.inner), poisoned=Batched.forks % 2 == 1)  # every other row is poisoned

    def propose(self, ctx):
        if self.poisoned:
            raise RuntimeError("poisoned row")
        return self.inner.propose(ctx)

    @staticmethod
    def propose_many(rows, ctxs):
        Batched.batched_calls += 1
        if any(row.poisoned for row in rows):
            raise RuntimeError("batched draft failed")
        return [row.inner.propose(ctx) for row, ctx in zip(rows, ctxs)]


def test_a_failed_batched_draft_falls_back_only_on_the_rows_that_fail_alone(target):
    reports = Reports()
    engine = Engine(target, Batched(ngram(target)), fallback=reports, max_rows=4)
    Batched.batched_calls = Batched.forks = 0
    seqs = [engine.add(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    while any(not s.done for s in seqs):
        engine.step()
    assert [s.output for s in seqs] == [plain(target, p) for p in PROMPTS]
    assert Batched.batched_calls > 0  # the rows were drafted together first
    poisoned = [isinstance(s.proposer, FallbackProposer) and s.proposer.inner.poisoned for s in seqs]
    assert poisoned == [False, True, False, True]
    assert all(s.stats.fallbacks > 0 for s, bad in zip(seqs, poisoned) if bad)
    assert all(s.stats.fallbacks == 0 for s, bad in zip(seqs, poisoned) if not bad)
    assert {reason for reason, _ in reports} == {"proposer_error"}
    assert all("poisoned row" in message for _, message in reports)

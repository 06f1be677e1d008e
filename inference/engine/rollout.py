"""Rollouts: prompts decoded together by the engine with a drafter, keeping where each step's draft failed.

A training recipe's on-policy phase (`specheads.train.onpolicy`) decodes training prompts with the drafter it is
training and trains where that drafter failed at decode time (Draft-OPD's replay from rejected positions). The
decoding is the engine's own, exact: a greedy rollout's text is the target's greedy text whatever the drafter, and a
sampled one follows the target's distribution. What the drafter adds is where it failed: each verified step that
drafted something is recorded as a `DraftStep` (where its new tokens begin in the output, how many draft tokens were
accepted, and whether a drafted token was rejected after them or the accepted path ran to the end of its branch).

The record is kept by a speculation policy (`speculation.py`, the engine's one per-step hook) that drafts as the
one it wraps says, so rollouts need nothing of the engine loop beyond what every generation runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import Proposer
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.speculation import AlwaysSpeculate, RowState, Speculation
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult


@dataclass(frozen=True)
class DraftStep:
    """One verified step that drafted something."""

    start: int  # the output index of the step's first new token (the first drafted position)
    drafted: int  # draft tokens in its tree
    accepted: int  # draft tokens accepted
    rejected: bool  # a drafted token was rejected at output index start + accepted (False: the draft ran out)


@dataclass
class Rollout:
    """One prompt's decoding: its output and the steps that drafted."""

    prompt: list[int]
    output: list[int]  # the committed tokens after the prompt (a stop token kept)
    steps: list[DraftStep]  # in order
    stats: GenerationStats

    def failures(self) -> list[int]:
        """Output indices of the steps' first rejected positions (where the target's token replaced the draft's)."""
        return [s.start + s.accepted for s in self.steps if s.rejected and s.start + s.accepted < len(self.output)]


@dataclass
class _StepLog:
    """Drafts as `inner` says and records, per row, every step's (drafted, accepted, rejected, tokens committed)."""

    inner: Speculation = field(default_factory=AlwaysSpeculate)
    steps: dict[int, list[tuple[int, int, bool, int]]] = field(default_factory=dict)  # id(row) -> steps

    def enabled(self, batch: int) -> bool:
        return self.inner.enabled(batch)

    def start(self, row: RowState) -> None:
        self.steps[id(row)] = []
        self.inner.start(row)

    def depth(self, row: RowState, batch: int) -> int | None:
        return self.inner.depth(row, batch)

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        self.inner.observe(row, batch, tree, result)
        last = int(result.path[-1])
        rejected = bool((tree.parents.cpu() == last).any())  # the accepted path stopped before its branch's end
        self.steps[id(row)].append((tree.num_drafted, result.num_accepted, rejected, int(result.tokens.numel())))


def _draft_steps(log: list[tuple[int, int, bool, int]]) -> list[DraftStep]:
    steps, start = [], 0
    for drafted, accepted, rejected, committed in log:  # the prefill's step first: it drafts nothing
        if drafted:
            steps.append(DraftStep(start, drafted, accepted, rejected))
        start += committed
    return steps


def rollout(target: PreTrainedModel, proposer: Proposer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
            stop_token_ids: Sequence[int] = (), sampling: SamplingParams = SamplingParams(),
            rows: int = 8) -> list[Rollout]:
    """Decode `prompts` (token ids), up to `rows` at a time in one batch, with `proposer`; each prompt's rollout in
    order. Sampling draws are seeded per prompt (`SamplingParams.for_draw`), as the bench's are."""
    log = _StepLog()
    engine = Engine(target, proposer, max_rows=rows, speculation=log)
    seqs = [engine.add(list(p), max_new_tokens=max_new_tokens, sampling=sampling.for_draw(i),
                       stop_token_ids=stop_token_ids) for i, p in enumerate(prompts)]
    while not all(s.done for s in seqs):
        engine.step()
    return [Rollout(list(p), list(s.output), _draft_steps(log.steps[id(s.policy)]), s.stats)
            for p, s in zip(prompts, seqs)]

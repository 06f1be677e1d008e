"""One sequence in the engine: the request that asked for it and its state while it decodes as a row of the batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specheads.inference.engine.output_constraint import UNCONSTRAINED, OutputConstraint, TargetHidden
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.speculation import RowState
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.engine.tree import DraftTree


@dataclass(frozen=True, eq=False)  # identity: a request is one ask, whatever its contents
class Request:
    """What a caller asks of `Engine.add`."""

    prompt: torch.Tensor  # [P] long on CPU, P >= 1
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the answer (kept in the output)
    on_tokens: Callable[[list[int]], None] | None = None  # told each step's new tokens
    should_stop: Callable[[], str | None] | None = None  # asked after each step: a finish reason ends the sequence
    constraint: OutputConstraint = UNCONSTRAINED  # a grammar its output follows (structured outputs)


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats


@dataclass(eq=False)  # identity: rows are found in the engine's lists by which sequence they are
class Generation:
    """One sequence being decoded: a row of the engine's batch."""

    request: Request
    proposer: Proposer  # its own (a fork after the first row), wrapped in `FallbackProposer` under a fallback handler
    generator: torch.Generator | None  # on the target's device, seeded from the sampling params (None: global RNG)
    stops: frozenset[int]  # the request's stop tokens and its constraint's end tokens
    tokens: torch.Tensor  # [limit + 1] long on CPU: the prompt, then the committed output
    limit: int  # the most tokens (prompt + output) this sequence may reach
    length_limited: bool  # whether `limit` is the request's max_new_tokens (else the model's context)
    started: float  # when it was added (time.perf_counter)
    stats: GenerationStats = field(default_factory=GenerationStats)
    output: list[int] = field(default_factory=list)
    n: int = 0  # tokens committed (prompt included)
    tree: DraftTree | None = None  # the tree its next verify forward checks
    hidden: TargetHidden | None = None  # the target's hidden states over that forward's nodes (for on_verified)
    extra_logits: torch.Tensor | None = None  # [E, V] the target's logits at that forward's extra rows (on_verified)
    row: int = -1  # its row in the cache, once prefilled
    policy: RowState = field(default_factory=RowState)  # what the engine's speculation policy keeps for it

    @property
    def n_prompt(self) -> int:
        return self.request.prompt.shape[0]

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def constraint(self) -> OutputConstraint:
        return self.request.constraint

    @property
    def done(self) -> bool:
        return bool(self.stats.finish_reason)

    def context(self) -> ProposalContext:
        room = self.limit - self.n  # tokens that may still be committed, the bonus included
        return ProposalContext(tokens=self.tokens[: self.n], num_prompt_tokens=self.n_prompt,
                               max_depth=max(room - 1, 0), sampling=self.sampling, generator=self.generator)

    def result(self) -> GenerationResult:
        return GenerationResult(output_ids=list(self.output), stats=self.stats)

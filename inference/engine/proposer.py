"""The one interface every proposer implements, so the engine never branches on type."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult


@dataclass(frozen=True)
class ProposalContext:
    tokens: torch.Tensor  # [T] long on CPU; prompt + committed output; tokens[-1] is the next tree root
    num_prompt_tokens: int
    max_depth: int  # deepest draft worth proposing (remaining new tokens / context room, minus the bonus)
    sampling: SamplingParams
    generator: torch.Generator | None  # on the proposer's device, seeded from the sampling params
    batch: int = 1  # rows in the verify forward this tree joins (each pays the widest row's tree)


@runtime_checkable
class Proposer(Protocol):
    """Drafts a tree of tokens rooted at the last committed token.

    `start` is called once per generation after the prompt prefill, `propose` for each
    step that drafts, and `on_verified` after the target has verified each tree (the
    prefill is the first, root-only, step: its root is the prompt's last token). Steps the
    engine decodes plainly (adaptive speculation, fallbacks) verify a root-only tree without
    asking `propose`, so a proposer must not assume a `propose` preceded `on_verified`. When
    `needs_target_hidden` is set, `start` receives the target's hidden states (HF
    `hidden_states`: one [1, n, H] tensor per layer, embeddings first) over the prompt
    minus its last token (None for a one-token prompt), and `on_verified` those over
    the verified tree's nodes; otherwise None.
    """

    needs_target_hidden: bool

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None: ...

    def propose(self, ctx: ProposalContext) -> DraftTree: ...

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None: ...


def target_layers(proposer: Proposer) -> tuple[int, ...] | None:
    """The target's hidden_states indices `proposer` reads (-1: the last), from its optional `target_layers`: () when
    it reads none; None when it reads some without naming them (every layer, which a backend that keeps only named
    layers, llama.cpp's, refuses)."""
    if not proposer.needs_target_hidden:
        return ()
    return getattr(proposer, "target_layers", None)


def verified_on(proposer: Proposer, backend) -> None:
    """Tell `proposer` which backend (`target_backend.py`) verifies its trees, through its optional
    `verified_on(backend)`: a proposer that weighs trees by their verify cost measures that backend's."""
    if hasattr(proposer, "verified_on"):
        proposer.verified_on(backend)


def fork(proposer: Proposer) -> Proposer:
    """A proposer for another sequence: the same drafter (weights shared) with its own per-sequence state. A shallow
    copy, which `start` gives fresh state, unless the proposer defines `fork()` because it keeps per-sequence state
    in objects `start` does not replace (a wrapped proposer, a request's vocabulary)."""
    return proposer.fork() if hasattr(proposer, "fork") else copy.copy(proposer)


def finish(proposer: Proposer) -> None:
    """Tell `proposer` its sequence ended (an optional `finish()`: a proposer holding a row of a shared cache frees
    it)."""
    done = getattr(proposer, "finish", None)
    if done is not None:
        done()


def finished(proposer: Proposer, tokens: torch.Tensor) -> None:
    """Tell `proposer` its sequence ended by decoding, with its whole text `tokens` [T] (prompt, then output; an
    optional `on_finished(tokens)`). The last step's tokens never reach `on_verified` (nothing is drafted after them),
    so a proposer that keeps what its sequences produced (suffix decoding's cache of answers) reads them here. A
    sequence dropped mid-way (`Engine.abort`) is not finished: only `finish` hears of it."""
    done = getattr(proposer, "on_finished", None)
    if done is not None:
        done(tokens)


def drafts_together(proposers: Sequence[Proposer]) -> bool:
    """Whether these rows' proposers are of one class that drafts rows together (a static
    `propose_many(proposers, ctxs)`, e.g. heads whose forwards batch)."""
    kind = type(proposers[0]) if proposers else None
    return (len(proposers) > 1 and hasattr(kind, "propose_many")
            and all(type(p) is kind for p in proposers))


def propose_rows(proposers: Sequence[Proposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
    """Each row's tree, for a batch of rows: one `propose_many` call where they draft together, else each row's
    `propose`. Either way row i's tree is the one `proposers[i].propose(ctxs[i])` would draft."""
    if drafts_together(proposers):
        return type(proposers[0]).propose_many(proposers, ctxs)
    return [p.propose(c) for p, c in zip(proposers, ctxs)]


class AutoregressiveProposer:
    """`ar`: proposes nothing, so each step is one plain target forward in the same engine."""

    needs_target_hidden = False

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        pass

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return DraftTree.root_only(ctx.tokens[-1])

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        pass


def build_autoregressive(target, options, load_draft) -> AutoregressiveProposer:
    """The `ar` method's proposer (`specheads.inference.methods.ar`)."""
    return AutoregressiveProposer()

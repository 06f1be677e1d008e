"""Proposer failures that cost a step, never the sequence: `FallbackProposer` wraps one row's proposer so that a
proposer that raises, or returns a tree the target cannot verify as the next step, makes that step a plain
(root-only) step, which is exact like any other, and is reported. The engine wraps rows' proposers in it only when
it has a fallback handler (a server); without one, proposer errors propagate (benchmarks and tests want them loud)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specheads.inference.engine.proposer import (
    ProposalContext,
    Proposer,
    drafts_together,
    finish,
    finished,
    fork,
    propose_rows,
    target_layers,
)
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult

FallbackHandler = Callable[[str, Exception], None]  # (reason, error): told of each step that fell back


def check_proposal(tree: DraftTree, ctx: ProposalContext, vocab_size: int) -> None:
    """Raise ValueError if a proposer's tree cannot be verified as the next step: its root must be the last committed
    token (a wrong root would be fed to the target as if committed) and every token an id of the target's vocabulary."""
    if int(tree.tokens[0]) != int(ctx.tokens[-1]):
        raise ValueError(f"the tree's root is token {int(tree.tokens[0])}, not the last committed token "
                         f"{int(ctx.tokens[-1])}")
    low, high = int(tree.input_tokens.min()), int(tree.input_tokens.max())  # extra rows' tokens are fed too
    if low < 0 or high >= vocab_size:
        raise ValueError(f"the tree holds token ids in [{low}, {high}], outside the target's vocabulary of "
                         f"{vocab_size}")


class FallbackProposer:
    """One row's proposer, guarded. A failure reports ("proposer_error" or "malformed_tree", the error) to
    `on_fallback` once and costs one plain step: a `propose` that raises or drafts a tree `check_proposal` refuses is
    answered with the root alone; a `start` or `on_verified` that raises leaves the proposer behind the sequence, so
    its next `propose` is answered with the root alone without asking it (its later ones ask it again)."""

    def __init__(self, inner: Proposer, vocab_size: int, on_fallback: FallbackHandler) -> None:
        self.inner, self.vocab_size, self.on_fallback = inner, vocab_size, on_fallback
        self._behind = False  # a start or on_verified failed since the last propose

    @property
    def needs_target_hidden(self) -> bool:
        return self.inner.needs_target_hidden

    @property
    def target_layers(self) -> tuple[int, ...] | None:
        return target_layers(self.inner)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._behind = False
        self._guard(self.inner.start, ctx, target_hidden)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._guard(self.inner.on_verified, result, target_hidden)

    def propose(self, ctx: ProposalContext) -> DraftTree:
        if self._behind:
            self._behind = False
            return DraftTree.root_only(ctx.tokens[-1])
        try:
            tree = self.inner.propose(ctx)
        except Exception as err:  # noqa: BLE001 - whatever the proposer's failure, this step decodes plainly
            return self._plain("proposer_error", err, ctx)
        return self._checked(tree, ctx)

    @staticmethod
    def propose_many(rows: Sequence[FallbackProposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """Each row's tree as its `propose` would draft it: rows whose proposers draft together still do (one batched
        call); if that call raises, each drafts alone, so only the rows that fail alone fall back."""
        ready = [i for i, row in enumerate(rows) if not row._behind]
        inner = [rows[i].inner for i in ready]
        if drafts_together(inner):
            try:
                drafted = propose_rows(inner, [ctxs[i] for i in ready])
            except Exception:  # noqa: BLE001 - find the failing rows: each drafts alone, failing alone
                pass
            else:
                trees = [row.propose(ctx) if row._behind else None for row, ctx in zip(rows, ctxs)]
                for i, tree in zip(ready, drafted):
                    trees[i] = rows[i]._checked(tree, ctxs[i])
                return trees
        return [row.propose(ctx) for row, ctx in zip(rows, ctxs)]

    def fork(self) -> FallbackProposer:
        return FallbackProposer(fork(self.inner), self.vocab_size, self.on_fallback)

    def finish(self) -> None:
        finish(self.inner)

    def on_finished(self, tokens: torch.Tensor) -> None:
        finished(self.inner, tokens)

    def _guard(self, call: Callable, *args) -> None:
        try:
            call(*args)
        except Exception as err:  # noqa: BLE001 - whatever the proposer's failure, its next step decodes plainly
            self._behind = True
            self.on_fallback("proposer_error", err)

    def _checked(self, tree: DraftTree, ctx: ProposalContext) -> DraftTree:
        try:
            check_proposal(tree, ctx, self.vocab_size)
        except ValueError as err:
            return self._plain("malformed_tree", err, ctx)
        return tree

    def _plain(self, reason: str, err: Exception, ctx: ProposalContext) -> DraftTree:
        self.on_fallback(reason, err)
        return DraftTree.root_only(ctx.tokens[-1])

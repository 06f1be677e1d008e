"""The one hook through which a constraint on a sequence's output (a grammar: `constraint.py`) takes part in each
step: it shapes the step's tree, masks the verify logits, follows the committed tokens and translates the result back
into the proposer's own tree. A sequence without one has `UNCONSTRAINED`, which changes nothing, so the engine calls
the hook on every row alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult

TargetHidden = tuple[torch.Tensor, ...]  # one [1, N, H] tensor per layer (embeddings first), HF's hidden_states


class OutputConstraint(Protocol):
    end_tokens: tuple[int, ...]  # tokens that end the answer where the constraint accepts (they join its stops)

    def shape(self, tree: DraftTree, max_depth: int) -> DraftTree:
        """The tree to verify instead of the proposer's, no deeper than `max_depth`."""
        ...

    def mask_logits(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """The verify logits [N, V] of the shaped `tree` under the constraint (in place allowed)."""
        ...

    def commit(self, tokens: Iterable[int]) -> None:
        """Follow the tokens the step committed (called only while the sequence goes on)."""
        ...

    def proposer_view(self, result: VerifyResult, hidden: TargetHidden | None
                      ) -> tuple[VerifyResult, TargetHidden | None]:
        """The step's result and hidden states in the nodes of the tree the proposer drafted."""
        ...


class Unconstrained:
    """No constraint: the proposer's tree, the target's logits, nothing to follow."""

    end_tokens: tuple[int, ...] = ()

    def shape(self, tree: DraftTree, max_depth: int) -> DraftTree:
        return tree

    def mask_logits(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def commit(self, tokens: Iterable[int]) -> None:
        pass

    def proposer_view(self, result: VerifyResult, hidden: TargetHidden | None
                      ) -> tuple[VerifyResult, TargetHidden | None]:
        return result, hidden


UNCONSTRAINED = Unconstrained()

"""How many drafted nodes are worth verifying, chosen per step from this machine's verify cost.

A step that verifies K nodes commits 1 + (expected accepted drafts) tokens and costs a K-node verify
forward. Where the forward's cost hardly grows with K (a GPU), big trees pay; where every node adds
GEMM work (a CPU), the nodes the proposer is unsure of cost more than they bring. Each step
`NodeBudget` keeps the K most probable nodes, with K maximising

    (1 + sum of the kept nodes' acceptance probabilities) / verify time(K)

and falls back to a plain step (K = 1) when no tree beats it. Drafting time stays out of the choice:
it is spent before the choice is made, and timing it live would make the trees, and so the draws of
a seeded sampling run, depend on machine load. The probabilities are the proposer's own
estimates (`DraftTree.accept_probs`: EAGLE's draft scores, prompt lookup's measured hit rates), which
are skewed; `Calibration` corrects them with what the target actually accepted in earlier steps.
Which nodes are verified never changes which tokens are accepted, so outputs stay exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specheads.inference.proposers.base import ProposalContext, Proposer, finish, fork, propose_rows
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult
from specheads.inference.verify_cost import VerifyCost, verify_cost

NODE_BUDGETS = ("auto", "fixed")  # the first is the default
NODE_BUDGET_HELP = (f"{', '.join(NODE_BUDGETS)}: per step verify only the drafted nodes worth their verify cost on this "
                    "machine (default; the cost curve is measured once, a few seconds, and cached), or the whole tree")

# Calibration bins over estimated acceptance probability: finer at the low end, where most nodes sit.
_EDGES = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], dtype=torch.float64)


class Calibration:
    """Estimated → observed acceptance probability, per bin, from the nodes the target has verified.

    Each bin starts with `prior` pseudo-nodes at the bin's own estimate, so early steps trust the
    proposer and a bin moves to the observed rate as evidence comes in.
    """

    def __init__(self, prior: float = 8.0) -> None:
        mids = (_EDGES[1:] + _EDGES[:-1]) / 2
        self.accepted = prior * mids  # [B] pseudo-counts
        self.seen = torch.full_like(mids, prior)  # [B]

    def _bins(self, probs: torch.Tensor) -> torch.Tensor:
        return (torch.bucketize(probs.clamp(0, 1), _EDGES[1:-1], right=True)).long()

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        """[N] estimates -> [N] calibrated probabilities (same order)."""
        return (self.accepted / self.seen)[self._bins(probs)]

    def observe(self, probs: torch.Tensor, accepted: torch.Tensor) -> None:
        """probs [N] the estimates of verified nodes, accepted [N] bool whether the target accepted each."""
        bins = self._bins(probs)
        self.seen.index_add_(0, bins, torch.ones_like(probs))
        self.accepted.index_add_(0, bins, accepted.to(probs.dtype))


class NodeBudget:
    """Prunes each drafted tree to the node count that maximises expected tokens per second."""

    def __init__(self, cost: VerifyCost, calibrate: bool = True, memory: int = 8) -> None:
        self.cost = cost
        self.calibration = Calibration() if calibrate else None
        self._table = cost.table()  # [M + 1] relative cost of an n-node verify
        self._weakest: deque[float] = deque(maxlen=memory)  # per recent step: raw estimate of the weakest kept node

    def _relative(self, n: int) -> torch.Tensor:  # [n]: entries 1..n of the cost table, extended if needed
        if n >= self._table.shape[0]:
            self._table = self.cost.table([2 * n])
        return self._table[1: n + 1]

    def expected(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated acceptance probability of each node, never above its parent's (root 1)."""
        assert tree.accept_probs is not None
        probs = self.calibration(tree.accept_probs) if self.calibration is not None else tree.accept_probs.clone()
        probs[0] = 1.0
        depths, parents = tree.depths.cpu(), tree.parents.cpu()
        for d in range(1, int(depths.max()) + 1):  # a path is accepted only if its prefix is: one level at a time
            level = (depths == d).nonzero().squeeze(1)
            probs[level] = torch.minimum(probs[level], probs[parents[level]])
        return probs

    def choose(self, tree: DraftTree) -> DraftTree:
        """The subtree worth verifying (the tree itself when it has no estimates)."""
        if tree.accept_probs is None or tree.size == 1:
            return tree
        probs = self.expected(tree)
        # Most probable first; ties go to the lower index, a parent before its child, so every prefix of
        # `order` is ancestor-closed (probabilities never grow along a path).
        order = torch.sort(probs[1:], descending=True, stable=True).indices + 1  # [N-1]
        gain = torch.cat([torch.ones(1, dtype=torch.float64), 1.0 + probs[order].cumsum(0)])  # [N]: K = 1..N nodes
        rate = gain / self._relative(tree.size)
        k = int(torch.argmax(rate))  # the first maximum: the smaller tree on a tie
        # Nothing below the weakest kept node was worth verifying (nothing at all on a plain step).
        raw = tree.accept_probs[order]
        self._weakest.append(float(raw[:k].min()) if k else float(raw.max()) + 1e-9)
        if k == tree.size - 1:
            return tree
        keep = torch.cat([torch.zeros(1, dtype=torch.long), order[:k].sort().values])
        return tree.subtree(keep)

    def stop_below(self) -> float:
        """Drafting deeper pays only for nodes above this estimate: the weakest node kept in recent steps
        (the lowest of them, so a step that happens to want more still gets it); 0 before any step.

        A child never scores above its parent, so a proposer whose best open node falls below it can stop
        expanding: the budget would prune everything deeper."""
        return min(self._weakest, default=0.0)

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        """Feed the calibration with which of `tree`'s (the verified tree's) nodes the target accepted."""
        if self.calibration is None or tree.accept_probs is None or tree.size == 1:
            return
        accepted = torch.zeros(tree.size, dtype=torch.bool)
        accepted[result.path.cpu()] = True
        self.calibration.observe(tree.accept_probs[1:], accepted[1:])


def check_node_budget(choice: str | None) -> None:
    if choice is not None and choice not in NODE_BUDGETS:
        raise ValueError(f"unknown --node-budget {choice!r}; use one of: {', '.join(NODE_BUDGETS)}")


def node_budget(target: PreTrainedModel, choice: str | None) -> NodeBudget | None:
    """The node budget `choice` names, on `target`'s verify cost (None: trees are verified whole)."""
    check_node_budget(choice)
    return NodeBudget(verify_cost(target)) if (choice or NODE_BUDGETS[0]) == "auto" else None


def with_node_budget(proposer: Proposer, budget: NodeBudget | None) -> Proposer:
    """`proposer` with its trees pruned by `budget` (as it is without one)."""
    return proposer if budget is None else WithNodeBudget(proposer, budget)


class WithNodeBudget:
    """`inner`'s trees pruned by `budget`."""

    def __init__(self, inner: Proposer, budget: NodeBudget) -> None:
        self.inner = inner
        self.budget = budget
        self.needs_target_hidden = inner.needs_target_hidden
        self._verified: DraftTree | None = None

    def fork(self) -> WithNodeBudget:  # the budget (this machine's costs, the drafter's calibration) is shared
        return WithNodeBudget(fork(self.inner), self.budget)

    def finish(self) -> None:
        finish(self.inner)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._verified = None
        self.inner.start(ctx, target_hidden)

    def propose(self, ctx: ProposalContext) -> DraftTree:
        self._verified = self.budget.choose(self.inner.propose(ctx).truncated(ctx.max_depth))
        return self._verified

    @staticmethod
    def propose_many(rows: Sequence[WithNodeBudget], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        for r, tree, ctx in zip(rows, propose_rows([r.inner for r in rows], ctxs), ctxs):
            r._verified = r.budget.choose(tree.truncated(ctx.max_depth))
        return [r._verified for r in rows]

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        if self._verified is not None:
            self.budget.observe(self._verified, result)
            self._verified = None  # observed once: the engine may verify plain steps without asking for a draft
        self.inner.on_verified(result, target_hidden)

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

A drafter whose trees the budget keeps nothing of costs its forward for nothing. After SKIP_AFTER steps in a row
whose draft the budget cut down to the root (steps where the drafter proposed nothing do not count), `WithNodeBudget`
stops asking the drafter and steps plainly (the root alone, which every proposer takes: the engine's own plain steps
never call `propose`) for a wait that doubles while its probes still keep nothing (1, 2, 4, ... up to MAX_WAIT
steps), and drafts again at once when a probe keeps a node. Over a request where no tree pays,
that is a plain decode with one draft every MAX_WAIT + 1 steps; where trees pay again (a stretch of repeated text),
speculation is back within the wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.proposer import (
    ProposalContext,
    Proposer,
    finish,
    finished,
    fork,
    propose_rows,
    target_layers,
    verified_on,
)
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.options import NODE_BUDGETS, check_node_budget
from specheads.inference.proposers.verify_cost import VerifyCost, VerifyCosts

SKIP_AFTER = 4  # steps in a row whose tree the budget kept nothing of, before the drafter is left out
MAX_WAIT = 16  # most steps decoded plainly between two probes

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
    """Prunes drafted trees to the node count that maximises expected tokens per second.

    In a batch the rows' trees are chosen together: the forward pads every row to the widest tree, so a width W costs
    every row the verify time of W nodes at that batch size, and is worth it only if the drafted nodes the rows keep
    within it bring enough: the choice maximises (rows + the kept nodes' acceptance probabilities) / verify time(W,
    rows), and each tree keeps its W most probable nodes. A lone row (a batch of one) is the rule of the module doc.
    """

    def __init__(self, cost: VerifyCost | VerifyCosts, calibrate: bool = True, memory: int = 8) -> None:
        self.costs = cost if isinstance(cost, VerifyCosts) else VerifyCosts(fixed=cost)
        self.calibration = Calibration() if calibrate else None
        self._tables: dict[int, torch.Tensor] = {}  # batch -> [M + 1] relative cost of an n-node verify
        self._weakest: deque[float] = deque(maxlen=memory)  # per recent step: raw estimate of the weakest kept node

    def measure_on(self, backend) -> None:
        """Weigh trees by `backend`'s verify cost (`VerifyCosts.measure_on`)."""
        self.costs.measure_on(backend)
        self._tables.clear()

    @property
    def cost(self) -> VerifyCost:
        """The verify cost curve of a lone row."""
        return self.costs.at(1)

    def _relative(self, n: int, batch: int) -> torch.Tensor:  # [n]: entries 1..n of the cost table, extended if needed
        table = self._tables.get(batch)
        if table is None or n >= table.shape[0]:
            cost = self.costs.at(batch)
            table = self._tables[batch] = cost.table([max(2 * n, cost.nodes[-1])])
        return table[1: n + 1]

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

    def choose(self, tree: DraftTree, batch: int = 1) -> DraftTree:
        """The subtree worth verifying (the tree itself when it has no estimates), for a row of a `batch`-row verify
        in which no other row drafts."""
        return self.choose_rows([tree], batch)[0]

    def choose_rows(self, trees: Sequence[DraftTree], batch: int = 1) -> list[DraftTree]:
        """The subtrees worth verifying for rows that verify together with `batch` - len(trees) plain rows (a tree
        without estimates is kept whole, and the others may then fill its width)."""
        batch = max(batch, len(trees))
        whole = 1  # the widest tree that must be verified whole
        ranked = []  # (row, order, calibrated probabilities in that order) of the trees with estimates
        for i, tree in enumerate(trees):
            if tree.accept_probs is None:
                whole = max(whole, tree.size)
            elif tree.size > 1:
                probs = self.expected(tree)
                # Most probable first; ties go to the lower index, a parent before its child, so every prefix of
                # `order` is ancestor-closed (probabilities never grow along a path).
                order = torch.sort(probs[1:], descending=True, stable=True).indices + 1  # [N-1]
                ranked.append((i, order, probs[order]))
        if not ranked:
            return list(trees)
        top = max(t.size for t in trees)
        gain = torch.full((top,), float(batch), dtype=torch.float64)  # [W]: tokens expected at width W = 1..top
        for _, _, probs in ranked:
            kept = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(0)])  # [N]: k = 0..N-1 drafted nodes
            gain[: kept.shape[0]] += kept
            gain[kept.shape[0]:] += kept[-1]
        rate = gain / self._relative(top, batch)
        rate[: whole - 1] = -torch.inf  # narrower than a tree kept whole: not on offer
        width = int(torch.argmax(rate)) + 1  # the first maximum: the narrower width on a tie
        chosen, weakest, best = list(trees), [], []
        for i, order, _ in ranked:
            tree = trees[i]
            k = min(width, tree.size) - 1  # its drafted nodes kept
            raw = tree.accept_probs[order]
            best.append(float(raw.max()))
            if k:
                weakest.append(float(raw[:k].min()))
            if k < tree.size - 1:
                chosen[i] = tree.subtree(torch.cat([torch.zeros(1, dtype=torch.long), order[:k].sort().values]))
        # Nothing below the weakest kept node was worth verifying (nothing at all on a plain step).
        self._weakest.append(min(weakest) if weakest else max(best) + 1e-9)
        return chosen

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
        path = result.path.cpu()
        accepted[path[path < tree.size]] = True  # nodes past the tree's end were added by the engine (forced tokens)
        self.calibration.observe(tree.accept_probs[1:], accepted[1:])


def node_budget(target: PreTrainedModel, choice: str | None) -> NodeBudget | None:
    """The node budget `choice` names, on `target`'s verify cost (None: trees are verified whole)."""
    check_node_budget(choice)
    return NodeBudget(VerifyCosts(target)) if (choice or NODE_BUDGETS[0]) == "auto" else None


def with_node_budget(proposer: Proposer, budget: NodeBudget | None) -> Proposer:
    """`proposer` with its trees pruned by `budget` (as it is without one)."""
    return proposer if budget is None else WithNodeBudget(proposer, budget)


class WithNodeBudget:
    """`inner`'s trees pruned by `budget`; no draft asked for while the budget keeps nothing (see the module doc)."""

    def __init__(self, inner: Proposer, budget: NodeBudget) -> None:
        self.inner = inner
        self.budget = budget
        self.needs_target_hidden = inner.needs_target_hidden
        self.target_layers = target_layers(inner)
        self._verified: DraftTree | None = None
        self._idle = 0  # steps in a row whose tree kept no drafted node
        self._wait = 1  # plain steps before the next probe, once idle
        self._skip = 0  # plain steps left before the drafter is asked again

    def verified_on(self, backend) -> None:
        self.budget.measure_on(backend)
        verified_on(self.inner, backend)

    def fork(self) -> WithNodeBudget:  # the budget (this machine's costs, the drafter's calibration) is shared
        return WithNodeBudget(fork(self.inner), self.budget)

    def finish(self) -> None:
        finish(self.inner)

    def on_finished(self, tokens: torch.Tensor) -> None:
        finished(self.inner, tokens)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._verified = None
        self._idle, self._wait, self._skip = 0, 1, 0
        self.inner.start(ctx, target_hidden)

    def propose(self, ctx: ProposalContext) -> DraftTree:
        if self._skipping():
            return DraftTree.root_only(ctx.tokens[-1])
        drafted = self.inner.propose(ctx).truncated(ctx.max_depth)
        return self._kept(drafted, self.budget.choose(drafted, ctx.batch))

    @staticmethod
    def propose_many(rows: Sequence[WithNodeBudget], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """The rows' trees, chosen together when they share a budget (forks do): they pad one verify forward. Rows
        waiting out an idle stretch step plainly without drafting."""
        trees = [DraftTree.root_only(c.tokens[-1]) if r._skipping() else None for r, c in zip(rows, ctxs)]
        asked = [i for i, tree in enumerate(trees) if tree is None]
        if not asked:
            return trees
        drafted = propose_rows([rows[i].inner for i in asked], [ctxs[i] for i in asked])
        drafted = [t.truncated(ctxs[i].max_depth) for i, t in zip(asked, drafted)]
        budget = rows[asked[0]].budget
        if all(rows[i].budget is budget for i in asked):
            chosen = budget.choose_rows(drafted, max(c.batch for c in ctxs))
        else:
            chosen = [rows[i].budget.choose(t, ctxs[i].batch) for i, t in zip(asked, drafted)]
        for i, tree, kept in zip(asked, drafted, chosen):
            trees[i] = rows[i]._kept(tree, kept)
        return trees

    def _skipping(self) -> bool:
        """Whether this step is one of an idle stretch's plain steps (counted off here)."""
        if self._skip == 0:
            return False
        self._skip -= 1
        self._verified = None
        return True

    def _kept(self, drafted: DraftTree, kept: DraftTree) -> DraftTree:
        """`kept` (the budget's choice of `drafted`), after counting whether the budget cut a draft down to the root
        (the idle stretch's bookkeeping). A drafter that proposed nothing (a lookup without a match) is not idle in
        this sense: its forward, if any, found nothing to pay for, and skipping it would miss the next match."""
        self._verified = kept
        if kept.size > 1:
            self._idle, self._wait = 0, 1
        elif drafted.size > 1:
            self._idle += 1
            if self._idle >= SKIP_AFTER:  # idle long enough: wait, then probe (one more idle probe waits longer)
                self._skip, self._wait, self._idle = self._wait, min(2 * self._wait, MAX_WAIT), SKIP_AFTER - 1
        return kept

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        if self._verified is not None:
            self.budget.observe(self._verified, result)
            self._verified = None  # observed once: the engine may verify plain steps without asking for a draft
        self.inner.on_verified(result, target_hidden)

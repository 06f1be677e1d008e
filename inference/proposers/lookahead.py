"""`lookahead`: lookahead decoding (Fu et al., ICML 2024), training-free and without a draft model.

Each step's verify forward runs two branches at once:

1. The verification branch: the tree. Up to `candidates` n-grams of the pool (`ngram_pool.py`) stored under the
   root, most recent first, are merged into a trie below it (`ngram` - 1 tokens each).
2. The lookahead branch: the Jacobi window (`jacobi_window.py`), fed as the tree's extra rows (`extra_rows.py`).
   Its rows see the prefix, the root and their own column's chain, never a node, and no node sees them; their
   KV entries are never committed. The target's argmax at the window's last level makes its next level, and each
   column's trajectory becomes an n-gram of the pool.

With `lazy_window` (the default) a step runs the window only beside n-grams of the pool worth their cost: each
n-gram's tokens carry an estimate of being accepted (`HitRates`: per depth, how often a drafted token equalled the
committed one in this request, counted for every n-gram looked up, verified or not), and a step whose expected
tokens, 1 + the nodes' estimates, fall short of the wide forward's cost in one-token steps (`VerifyCosts`, measured
once on this machine) is a plain step. Without it every step runs the window, as the paper does on a GPU.

Drafts are deterministic (n-grams, not samples), so the verifier treats them as one-hot: exact under greedy and
sampling. Whatever the window holds changes which n-grams are drafted, never what is committed. The pool starts with
the prompt's n-grams (`prompt_pool`), so text the answer repeats drafts from the first step.

The window's rows are cut at the step's depth limit (`ProposalContext.max_depth`) like the tree's nodes, so no row
sits past a position the sequence may reach; near the end of a sequence the window runs partly or not at all.
"""

from __future__ import annotations

import torch

from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.lookahead import LookaheadOptions
from specheads.inference.methods.options import LookaheadConfig
from specheads.inference.proposers.jacobi_window import JacobiWindow
from specheads.inference.proposers.ngram import HitRates
from specheads.inference.proposers.ngram_pool import NgramPool
from specheads.inference.proposers.verify_cost import VerifyCosts


class LookaheadProposer:
    """The pool, window and hit rates of one sequence (`start` makes fresh ones, so a fork shares only `costs`, this
    machine's verify cost, which a lazy window weighs its steps against; None: a lazy window runs beside any draft)."""

    needs_target_hidden = False

    def __init__(self, config: LookaheadConfig = LookaheadConfig(), costs: VerifyCosts | None = None) -> None:
        self.config = config
        self.costs = costs
        self.pool = NgramPool(config.ngram, config.candidates)
        self.window: JacobiWindow | None = None
        self.hit_rates = HitRates(0, config.ngram - 1)
        self._proposed: list[list[int]] = []  # this step's n-grams (after the root), observed against the commit

    def verified_on(self, backend) -> None:
        if self.costs is not None:
            self.costs.measure_on(backend)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        prompt = ctx.tokens.tolist()
        self.pool = NgramPool(self.config.ngram, self.config.candidates)
        if self.config.prompt_pool:
            self.pool.add_text(prompt)
        self.window = JacobiWindow(self.config.window, self.config.ngram - 1, prompt)
        self.hit_rates = HitRates(0, self.config.ngram - 1)  # per request: how often n-grams hit is the text's
        self._proposed = []

    def propose(self, ctx: ProposalContext) -> DraftTree:
        root = int(ctx.tokens[-1])
        depth = min(self.config.ngram - 1, ctx.max_depth)
        paths = [list(c[:depth]) for c in self.pool.continuations(root, self.config.candidates)] if depth >= 1 else []
        self._proposed = paths
        probs = [self.hit_rates.path_probs(0, len(p)) for p in paths]
        tree = DraftTree.root_only(root).graft(paths, self.config.candidates * (self.config.ngram - 1), probs)
        if self.config.lazy_window and tree.size == 1:
            return tree  # a plain step: the window waits (it still moves with the text)
        rows = self.window.rows(root, ctx.max_depth)
        if rows is None:
            return tree
        width = tree.size + rows.size
        if self.config.lazy_window and self.costs is not None and tree.accept_probs is not None:
            expected = 1.0 + float(tree.accept_probs[1:].sum())  # tokens a step commits on average
            if expected < self.costs.at(ctx.batch).relative(width):  # a plain step commits 1 at cost 1
                return DraftTree.root_only(root)  # the window's rows go unanswered: `advance` sees no outputs
        return DraftTree(tokens=tree.tokens, parents=tree.parents, accept_probs=tree.accept_probs, extra=rows)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        committed = result.tokens.tolist()
        for cont in self._proposed:
            self.hit_rates.observe(0, cont, committed)
        self._proposed = []  # observed once: the engine may verify plain steps without asking for a draft
        outputs = None
        if result.extra_logits is not None and result.extra_logits.shape[0] == self.window.num_sent:
            outputs = result.extra_logits.argmax(dim=-1).tolist()
        for ngram in self.window.advance(len(committed), outputs):
            self.pool.add(ngram)


def build(target, options: LookaheadOptions, load_draft) -> Proposer:
    """The `lookahead` method's proposer (`specheads.inference.methods.lookahead`)."""
    config = options.config()
    return LookaheadProposer(config, VerifyCosts(target) if config.lazy_window else None)

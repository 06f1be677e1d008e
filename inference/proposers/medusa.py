"""`medusa`: Medusa heads draft a static top-k tree from the target's last hidden state.

After each verify forward the heads read the hidden state of the last accepted node
(whose LM-head prediction is the bonus token, i.e. the next root); head k's top
choices become the candidates at depth k + 1 of the next tree. The tree's shape is a
fixed list of paths (see `specheads.static_trees`), so all index bookkeeping is done once
here and each step only gathers token ids. Drafts are deterministic top-k, so
`draft_probs` stays None and verification is exact for greedy and sampling alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import nn

from specheads.formats.load import load_heads
from specheads.heads.medusa import KIND_NAME, MedusaHeads
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.medusa import DEFAULT_TREE, MEDUSA_TREES, MedusaOptions
from specheads.inference.proposers.lookup import with_heads_options
from specheads.int8 import quantize_linears
from specheads.static_trees import (
    prune_depth,
    resolve_tree,
    tree_depth,
    validate_tree,
)

log = logging.getLogger(__name__)

class MedusaProposer:
    """Drafts a static tree of Medusa heads' top-k tokens; needs the target's hidden states."""

    needs_target_hidden = True
    target_layers = (-1,)  # the last hidden state

    def __init__(self, heads: MedusaHeads, tree: list[list[int]]) -> None:
        """Pre-compute the tree once.

        1. Sort the paths breadth-first: node i + 1 is path i, parents come before children.
        2. Each step the heads' top-k ids form a [D, k_max] table (D = tree depth); path p's
           token sits at flat index (len(p) - 1) * k_max + p[-1], so one gather fills the tree.
        3. For every depth cap d the tree keeps a prefix of the nodes (breadth-first order);
           a template DraftTree per cap carries the parents/ancestors, built on first use.
        """
        paths = validate_tree(tree)
        depth = tree_depth(paths)
        if depth > heads.num_heads:
            raise ValueError(f"the tree is {depth} deep but the checkpoint has {heads.num_heads} medusa heads; "
                             f"use a tree at most {heads.num_heads} deep (a tree file with fewer levels) or heads "
                             "trained with more")
        self.heads = heads.eval()
        self.paths = paths
        self.depth = depth
        self.k_max = max(p[-1] for p in paths) + 1
        vocab = heads.config.scored_vocab_size
        if self.k_max > vocab:
            raise ValueError(f"the tree asks for choice {self.k_max - 1} but the vocabulary has {vocab} tokens; "
                             "use a narrower tree")
        node_of = {(): 0}
        parents = [-1]
        for i, p in enumerate(paths):
            node_of[tuple(p)] = i + 1
            parents.append(node_of[tuple(p[:-1])])
        self._parents = torch.tensor(parents, dtype=torch.long)
        self._gather = torch.tensor([(len(p) - 1) * self.k_max + p[-1] for p in paths], dtype=torch.long)
        # Nodes kept under a depth cap d: 1 (root) + paths no longer than d; a prefix thanks to BFS order.
        self._kept = [1 + sum(len(p) <= d for p in paths) for d in range(depth + 1)]
        # Path i's nodes' entries in the flat [D * k_max] table, padded with the extra last entry (log 1 = 0).
        pad = depth * self.k_max
        self._path_index = torch.tensor([[k * self.k_max + c for k, c in enumerate(p)] + [pad] * (depth - len(p))
                                         for p in paths], dtype=torch.long)  # [P, D]
        self._templates: dict[int, DraftTree] = {}
        self._topk: torch.Tensor | None = None  # [D * k_max] long on CPU; None until a hidden state is seen
        self._accept: torch.Tensor | None = None  # [P] fp64: each path's probability under the heads
        # The state the next draft reads, until it is read: a step the engine decodes plainly runs no heads.
        self._unread: torch.Tensor | None = None  # [H]

    @torch.inference_mode()
    def _read(self, hidden: torch.Tensor) -> None:  # hidden: [H], the target's last-layer state of one position
        self._take(self.heads(hidden.reshape(1, 1, -1), num_heads=self.depth)[:, 0, 0])

    def _take(self, logits: torch.Tensor) -> None:  # logits [D, V]: the heads' predictions for the next tree
        top = logits.float().log_softmax(-1).topk(self.k_max, dim=-1)
        self._topk = self.heads.token_ids(top.indices).flatten().cpu()  # [D * k_max] ids
        logp = torch.cat([top.values.flatten().double().cpu(), torch.zeros(1, dtype=torch.float64)])
        self._accept = logp[self._path_index].sum(1).exp()  # NodeBudget's estimate, as if heads were independent

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        # The prefill covers prompt[:-1]: its last state precedes the root (prompt[-1]), exactly as the
        # last accepted node precedes the bonus token after a verify step.
        self._topk, self._unread = None, None
        if target_hidden is not None:
            self._unread = target_hidden[-1][0, -1]

    def propose(self, ctx: ProposalContext) -> DraftTree:
        root = ctx.tokens[-1]
        cap = min(self.depth, ctx.max_depth)
        if self._unread is not None:
            self._read(self._unread)
            self._unread = None
        if self._topk is None or cap < 1:
            return DraftTree.root_only(root)
        n = self._kept[cap]
        tokens = torch.cat([root.reshape(1).to(torch.long), self._topk[self._gather[: n - 1]]])  # [n]
        accept = torch.cat([torch.ones(1, dtype=torch.float64), self._accept[: n - 1]])
        return self._template(cap).with_tokens(tokens, accept_probs=accept)

    @staticmethod
    @torch.inference_mode()
    def propose_many(rows: Sequence[MedusaProposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """Every row's tree, the heads reading all rows' states in one forward (rows sharing heads and tree)."""
        unread = [p for p in rows if p._unread is not None]
        first = unread[0] if unread else None
        if len(unread) > 1 and all(p.heads is first.heads and p.depth == first.depth for p in unread):
            hidden = torch.stack([p._unread.reshape(-1) for p in unread])[:, None]  # [B, 1, H]
            logits = first.heads(hidden, num_heads=first.depth)[:, :, 0]  # [D, B, V]
            for b, p in enumerate(unread):
                p._take(logits[:, b])
                p._unread = None
        return [p.propose(c) for p, c in zip(rows, ctxs)]

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        assert target_hidden is not None, "the engine must pass hidden states when needs_target_hidden is set"
        self._unread = target_hidden[-1][0, int(result.path[-1])]

    def _template(self, cap: int) -> DraftTree:
        tree = self._templates.get(cap)
        if tree is None:
            n = self._kept[cap]
            tree = DraftTree(tokens=torch.zeros(n, dtype=torch.long), parents=self._parents[:n].clone())
            self._templates[cap] = tree
        return tree


def load_medusa_proposer(path: str | os.PathLike, target_model: nn.Module, tree: str | None = None,
                         max_depth: int | None = None) -> MedusaProposer:
    """Medusa heads from a checkpoint folder, drafting `tree` (a preset name or YAML/JSON file).

    Without `tree`, the checkpoint's stored tree is used, else the DEFAULT_TREE preset, pruned to
    the checkpoint's head count if it has fewer heads than the preset is deep. `max_depth`
    (e.g. from --depth) prunes whichever tree is chosen.
    """
    if max_depth is not None and max_depth < 1:
        raise ValueError(f"the medusa tree depth must be >= 1, got {max_depth}")
    heads = load_heads(path, target_model, kind=KIND_NAME)
    if tree is not None:
        paths = resolve_tree(tree, MEDUSA_TREES)
    elif heads.config.tree is not None:
        paths = [list(p) for p in heads.config.tree]
    else:
        paths = prune_depth(MEDUSA_TREES[DEFAULT_TREE], heads.num_heads)
        log.info("heads in %s store no tree; using %s (%d nodes)", path, DEFAULT_TREE, len(paths))
    if max_depth is not None:
        paths = prune_depth(paths, max_depth)
    return MedusaProposer(heads, paths)


def build(target, options: MedusaOptions, load_draft) -> Proposer:
    """The `medusa` method's proposer (`specheads.inference.methods.medusa`)."""
    proposer = load_medusa_proposer(options.heads, target, tree=options.tree, max_depth=options.depth)
    if options.draft_dtype == "int8":
        quantize_linears(proposer.heads)  # the heads' own copies: a shared LM head stays as it is in the target
    return with_heads_options(proposer, target, options)

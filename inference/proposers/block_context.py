"""What the block drafters' proposers share (`dflash`, `dspark`, `xpress`, `dflash2`;
`specheads.heads.block_drafter`): the drafter's context over the committed text, and the block forward every row
drafts in.

Per sequence the proposer keeps every draft layer's context keys and values: one row per committed token except
the last (the anchor, whose target hidden state the next verify computes). After each verify the accepted path's
feature rows are projected into them (they are the positions right after the context, up to the new anchor).
Each step runs [anchor, mask, ...] in one forward over that context; a kind's `draft_group` turns the slots' outputs
into trees. Rows draft together: one forward for every row, each row attending over its own context.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specheads.features import feature_layers
from specheads.formats.load import load_heads
from specheads.heads.block_drafter import KV, BlockDrafterHead
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.tree_options import TreeConfig, TreeOptions, tree_config
from specheads.inference.proposers.lookup import with_heads_options
from specheads.inference.proposers.node_budget import node_budget
from specheads.int8 import quantize_linears


class BlockContextProposer:
    needs_target_hidden = True

    def __init__(self, head: BlockDrafterHead, config: TreeConfig) -> None:
        cfg = head.config
        if config.depth > cfg.drafted:
            raise ValueError(f"--depth {config.depth}: this {cfg.KIND} drafter fills blocks of {cfg.block_size} "
                             f"(the anchor and {cfg.block_size - 1} masked positions) and drafts {cfg.drafted} tokens "
                             f"a forward; use --depth {cfg.drafted} or less")
        self.head = head.eval()
        self.config = config
        self.device = next(head.parameters()).device
        self._buffers: list[KV] = []  # per layer: keys, values [1, kv_heads, capacity, d]
        self._context: list[KV] = []  # views of their first C entries (C = committed tokens - 1)
        self._length = 0  # C
        self._pending: torch.Tensor | None = None  # feature rows [m, D] of the next context positions

    @property
    def target_layers(self) -> tuple[int, ...]:
        return feature_layers(self.head.config.aux_layers)

    def fork(self) -> BlockContextProposer:
        new = copy.copy(self)
        new._buffers, new._context, new._length, new._pending = [], [], 0, None
        return new

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._buffers, self._context, self._length = [], [], 0
        self._pending = self.head.select_features(target_hidden)[0] if target_hidden is not None else None

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        assert target_hidden is not None, "the engine must pass hidden states when needs_target_hidden is set"
        rows = self.head.select_features(target_hidden)[0, result.path.to(target_hidden[-1].device)]  # [A+1, D]
        self._pending = rows if self._pending is None else torch.cat([self._pending, rows])

    @torch.inference_mode()
    def _extend(self) -> None:
        """Project the pending feature rows into every layer's context (buffers grown by doubling, so a step copies
        only its new rows)."""
        if self._pending is None or self._pending.shape[0] == 0:
            return
        m, n = self._pending.shape[0], self._length
        positions = torch.arange(n, n + m, device=self.device)[None]
        new = self.head.context_kv(self._pending[None].to(self.device), positions)
        if not self._buffers or n + m > self._buffers[0][0].shape[2]:
            size = max(2 * (n + m), 64)
            grown = []
            for layer, (k, v) in enumerate(new):
                kb, vb = k.new_zeros(*k.shape[:2], size, k.shape[3]), v.new_zeros(*v.shape[:2], size, v.shape[3])
                if self._buffers:
                    kb[:, :, :n], vb[:, :, :n] = self._buffers[layer][0][:, :, :n], self._buffers[layer][1][:, :, :n]
                grown.append((kb, vb))
            self._buffers = grown
        for (kb, vb), (k, v) in zip(self._buffers, new):
            kb[:, :, n : n + m], vb[:, :, n : n + m] = k, v
        self._length = n + m
        self._context = [(kb[:, :, : self._length], vb[:, :, : self._length]) for kb, vb in self._buffers]
        self._pending = None

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return type(self).propose_many([self], [ctx])[0]

    @classmethod
    @torch.inference_mode()
    def propose_many(cls, rows: Sequence[BlockContextProposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """Every row's tree, rows of one drafter in one forward (each row's tree is its lone one)."""
        trees: list[DraftTree | None] = [None] * len(rows)
        drafting: list[int] = []
        for i, (p, c) in enumerate(zip(rows, ctxs)):
            p._extend()
            if p._length == 0 or min(p.config.depth, c.max_depth) < 1:
                trees[i] = DraftTree.root_only(int(c.tokens[-1]))
            else:
                assert p._length == c.tokens.shape[0] - 1, "the context must cover every committed token but the last"
                drafting.append(i)
        groups: dict[int, list[int]] = {}
        for i in drafting:
            groups.setdefault(id(rows[i].head), []).append(i)
        for group in groups.values():
            for i, tree in zip(group, cls.draft_group([rows[i] for i in group], [ctxs[i] for i in group])):
                trees[i] = tree
        return trees

    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        """The trees of rows sharing one drafter, each with a context and a depth >= 1 (a kind's own)."""
        raise NotImplementedError


def block_forward(rows: Sequence[BlockContextProposer], ctxs: Sequence[ProposalContext]) -> torch.Tensor:
    """Every slot's output [B, block, H] for rows sharing one drafter: [anchor, mask, ...] after each row's context,
    the whole block as trained (its slots see each other), whatever the depth."""
    head, dev = rows[0].head, rows[0].device
    width = head.config.block_size
    lengths = [p._length for p in rows]
    tokens = torch.full((len(rows), width), head.config.mask_token_id, dtype=torch.long)
    tokens[:, 0] = torch.tensor([int(c.tokens[-1]) for c in ctxs])
    positions = (torch.tensor(lengths)[:, None] + torch.arange(width)).to(dev)
    # Projections and MLPs run over every row at once; each row attends over its own context, unpadded, so its
    # drafts are the ones it drafts alone.
    context = [[p._context[layer] for p in rows] for layer in range(len(head.layers))]
    return head(tokens.to(dev), positions, context)


def draft_depths(rows: Sequence[BlockContextProposer], ctxs: Sequence[ProposalContext]) -> list[int]:
    """How deep each row drafts: its tree's depth, cut to what the row may still commit."""
    return [min(p.config.depth, c.max_depth) for p, c in zip(rows, ctxs)]


def build_block_proposer(proposer: type[BlockContextProposer], kind: str, target: Any, options: TreeOptions,
                         limit: Callable[[TreeConfig, Any], TreeConfig] | None = None) -> Proposer:
    """A block drafter method's proposer: the `kind` drafter `options.heads` names (int8 if asked), a tree as deep as
    one forward drafts unless `--depth` says less (`limit(tree, drafter config)` narrows it further where a kind
    must), prompt lookup and the node budget as every heads method has them."""
    head = load_heads(options.heads, target, kind=kind)
    if options.draft_dtype == "int8":
        quantize_linears(head)
    tree = tree_config(options, options.depth or head.config.drafted)
    if limit is not None:
        tree = limit(tree, head.config)
    return with_heads_options(proposer(head, tree), target, options, node_budget(target, options.node_budget))

"""`xpress`: an XPress block drafter (`specheads.heads.xpress`) drafting up to block_size - 1 tokens per forward
(block_size with `sample_from_anchor`).

The drafter's context and block forward are `block_context`'s. One forward gives every slot's output; the refiner's
bias is then resolved by the drafter's Jacobi passes (`XPressHead.resolve`), every drafting row's block in each pass,
each row reading its own anchor and the token before it; the tree is built best-first from the resolved slots'
distributions (`block_tree`, as `dflash` does), so its first path is the block's resolved argmax chain and other
branches take the distributions that chain conditions. Drafts are deterministic top-k choices, so verification is
exact for greedy and sampling alike.
"""

from __future__ import annotations

import torch

from specheads.heads.xpress import KIND_NAME, XPressHead
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods.tree_options import TreeOptions
from specheads.inference.proposers.block_context import (
    BlockContextProposer,
    block_forward,
    build_block_proposer,
    draft_depths,
)
from specheads.inference.proposers.block_tree import block_tree


class XPressProposer(BlockContextProposer):
    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head: XPressHead = rows[0].head
        normed = head.norm(block_forward(rows, ctxs))  # [B, block, H]
        dev = normed.device
        # a drafting row has a context, so at least two committed tokens: the anchor and the one before it
        anchor = torch.tensor([int(c.tokens[-1]) for c in ctxs], device=dev)
        before = torch.tensor([int(c.tokens[-2]) for c in ctxs], device=dev)
        logits = head.resolve(normed, head.lm_head(normed), anchor, before)  # [B, block, Vd]
        logp = logits[:, head.config.first_slot:].float().log_softmax(-1)  # [B, S, Vd]
        return [block_tree(p.config, int(c.tokens[-1]), logp[b, :d], head.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, draft_depths(rows, ctxs)))]


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `xpress` method's proposer (`specheads.inference.methods.xpress`)."""
    return build_block_proposer(XPressProposer, KIND_NAME, target, options)

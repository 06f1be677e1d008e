"""`dflash`: a DFlash block drafter (`specheads.heads.dflash`) drafting up to block_size - 1 tokens per forward.

The drafter's context and block forward are `block_context`'s; each step builds the tree from the slots'
distributions best-first (`block_tree`, as `peagle` does). Drafts are deterministic top-k choices, so verification
is exact for greedy and sampling alike.
"""

from __future__ import annotations

from specheads.heads.dflash import KIND_NAME
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


class DFlashProposer(BlockContextProposer):
    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head = rows[0].head
        logp = head.draft_logits(block_forward(rows, ctxs)[:, 1:]).float().log_softmax(-1)  # [B, width-1, Vd]
        return [block_tree(p.config, int(c.tokens[-1]), logp[b, :d], head.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, draft_depths(rows, ctxs)))]


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `dflash` method's proposer (`specheads.inference.methods.dflash`)."""
    return build_block_proposer(DFlashProposer, KIND_NAME, target, options)

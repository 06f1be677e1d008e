"""`peagle`: P-EAGLE heads drafting a whole block in one head forward (`specheads.heads.peagle`).

EAGLE drafts level by level, one head forward per level. A P-EAGLE head reads, in one causal forward after the
committed pairs it has not seen, `depth - 1` mask entries, and gives a distribution for each of the next `depth`
tokens; the tree is built from those distributions best-first (`block_tree`). The head cache keeps only the
committed pairs (the mask entries are never committed), in the rows every fused-head proposer keeps (`HeadRows`,
`fused_tree`), and rows draft together: one head forward, one scoring GEMM for every row.

Drafts are deterministic top-k choices, so verification is exact for greedy and sampling alike.
"""

from __future__ import annotations

import torch

from specheads.heads.peagle import KIND_NAME, PEagleHead
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods.tree_options import TreeOptions
from specheads.inference.proposers.block_tree import block_tree
from specheads.inference.proposers.fused_tree import (
    FusedTreeProposer,
    HeadVocabulary,
    catch_up,
    score_rows,
    tree_proposer,
)


class PEagleProposer(FusedTreeProposer):
    """A fused-head proposer whose head drafts a block per forward (`config.depth` <= the head's num_depths)."""

    @staticmethod
    def draft_group(rows: list[FusedTreeProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head: PEagleHead = rows[0].head
        depths = [min(p.config.depth, c.max_depth) for p, c in zip(rows, ctxs)]
        hidden = catch_up(rows, masks=max(depths) - 1, mask_entry=(head.mask_features(), head.config.mask_token_id))
        logp = score_rows(rows, torch.stack(hidden))  # [B, K, C]
        return [block_tree(p.config, int(c.tokens[-1]), logp[b, :d], p.vocab.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, depths))]


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `peagle` method's proposer (`specheads.inference.methods.peagle`)."""
    return tree_proposer(target, options, KIND_NAME, HeadVocabulary, PEagleProposer)

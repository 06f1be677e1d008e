"""`domino`: a Domino block drafter (`specheads.heads.domino`) drafting up to block_size tokens per forward (the
anchor's slot drafts too).

The drafter's context and block forward are `block_context`'s. One forward gives every slot's normed output and base
logits; the tree is then drafted token by token (`path_tree`), as Domino's correction needs: each node carries the GRU
state after its own path (the root's after the anchor, a child's one step on from its parent's with the child's token),
and its children are the best tokens of its slot's base logits plus the correction read from that state (base logits
alone before `pure_draft_prefix_len`). So every branch is corrected after its own tokens, and the first path is the
corrected greedy chain. One GRU step and one correction per node that gets children; at most `total_tokens` nodes.
A node's draft probability is its path's (the node budget's estimates). Drafts are deterministic top-k choices, so
verification is exact for greedy and sampling alike.
"""

from __future__ import annotations

import torch

from specheads.heads.domino import KIND_NAME, DominoHead
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods.tree_options import TreeOptions
from specheads.inference.proposers.block_context import (
    BlockContextProposer,
    block_forward,
    build_block_proposer,
    draft_depths,
)
from specheads.inference.proposers.path_tree import Expand, path_tree


class DominoProposer(BlockContextProposer):
    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head: DominoHead = rows[0].head
        normed = head.norm(block_forward(rows, ctxs))  # [B, block, H]: slot d drafts the token at depth d + 1
        base = head.lm_head(normed)  # [B, block, V]
        return [path_tree(p.config, int(c.tokens[-1]), d, expander(head, normed[b], base[b]), head.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, draft_depths(rows, ctxs)))]


def expander(head: DominoHead, normed: torch.Tensor, base: torch.Tensor) -> Expand:
    """A row's `path_tree` expansion from its slots' normed outputs [block, H] and base logits [block, V]: a node at
    depth d (its token the one at the anchor's position + d) steps its parent's GRU state with its own token, and its
    children's distribution is slot d's."""
    states: dict[int, torch.Tensor] = {}  # node -> the GRU state [1, G] after the path to it (parents come first)

    def expand(node: int, parent: int, token: int, depth: int) -> tuple[torch.Tensor, None]:
        state = head.gru_step(torch.tensor([token], device=normed.device), states.get(parent))
        states[node] = state
        logits = base[depth]
        if depth >= head.config.suffix_start:  # one row ([1, ...]: an int8 drafter's linears take matrices)
            logits = head.corrected(logits[None], normed[depth][None], state)[0]
        return logits.float().log_softmax(-1), None

    return expand


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `domino` method's proposer (`specheads.inference.methods.domino`)."""
    return build_block_proposer(DominoProposer, KIND_NAME, target, options)

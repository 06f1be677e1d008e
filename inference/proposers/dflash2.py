"""`dflash2`: a DFlash2 block drafter (`specheads.heads.dflash2`) drafting up to block_size - 1 tokens per forward
(block_size with `sample_from_anchor`).

The drafter's context and block forward are `block_context`'s. One forward gives every slot's hidden state and unary
logits; the tree is then drafted token by token (`path_tree`): the children of a node at depth d are the d-th drafted
slot's candidates (its unary top-k, `selector_top_k`), ordered by the selector's scores after the node's own token
(the anchor for the root), so every branch reranks after its own previous token and the first path is the
selector's greedy chain. A child's draft log-probability is the unary top-k's probability mass shared out by the
softmax of the scores (the node budget's estimates). At most `selector_top_k` children per node. Drafts are
deterministic choices, so the reranking decides the tree's order only and verification stays exact for greedy and
sampling alike.
"""

from __future__ import annotations

import dataclasses

import torch

from specheads.heads.dflash2 import KIND_NAME, DFlash2Head
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


class DFlash2Proposer(BlockContextProposer):
    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head: DFlash2Head = rows[0].head
        normed = head.norm(block_forward(rows, ctxs))  # [B, block, H]
        unary = head.lm_head(normed[:, head.config.first_slot:]).float()  # [B, S, V]
        return [path_tree(p.config, int(c.tokens[-1]), d, _expander(head, normed[b], unary[b]), head.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, draft_depths(rows, ctxs)))]


def _expander(head: DFlash2Head, normed: torch.Tensor, unary: torch.Tensor) -> Expand:
    """A row's `path_tree` expansion from its slots' normed hidden [block, H] and unary logits [S, V]."""
    first = head.config.first_slot
    top = unary.topk(head.config.selector_top_k, dim=-1).indices  # [S, k]: the candidates, whatever the branch
    # log of the unary top-k's probability mass per slot: what the selector shares out among its candidates
    mass = unary.log_softmax(-1).gather(-1, top).logsumexp(-1)  # [S]

    def expand(node: int, parent: int, token: int, depth: int) -> tuple[torch.Tensor, None]:
        prev = torch.tensor([token], device=normed.device)
        # one row each ([1, ...]: an int8 drafter's linears take matrices)
        _, scores = head.candidates(unary[depth][None], normed[first + depth][None], prev, top[depth][None])
        scores = scores[0]  # [k]
        logp = torch.full_like(unary[depth], float("-inf"))
        return logp.scatter(-1, top[depth], scores.log_softmax(-1) + mass[depth]), None

    return expand


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `dflash2` method's proposer (`specheads.inference.methods.dflash2`)."""
    # a node's children are its slot's candidates only
    return build_block_proposer(DFlash2Proposer, KIND_NAME, target, options, lambda tree, cfg: dataclasses.replace(
        tree, topk=min(tree.topk, cfg.selector_top_k)))

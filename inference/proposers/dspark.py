"""`dspark`: a DSpark block drafter (`specheads.heads.dspark`) drafting up to block_size tokens per forward
(block_size - 1 without `sample_from_anchor`).

The drafter's context and block forward are `block_context`'s. One forward gives every slot's hidden state; the
tree is then drafted token by token (`path_tree`): the children of a node at depth d come from the d-th drafted
slot's logits plus the Markov bias of the node's own token (the anchor for the root), an embedding row times W2, so
every branch conditions on its own previous token; the confidence head's sigmoid at that slot (given the same
token) is the estimate that the best child is accepted, which the node budget weighs. Drafts are deterministic
top-k choices, so verification is exact for greedy and sampling alike.
"""

from __future__ import annotations

import torch

from specheads.heads.dspark import KIND_NAME, DSparkHead
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


class DSparkProposer(BlockContextProposer):
    @staticmethod
    def draft_group(rows: list[BlockContextProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        head: DSparkHead = rows[0].head
        normed = head.norm(block_forward(rows, ctxs))  # [B, block, H]
        base = head.lm_head(normed[:, head.config.first_slot:]).float()  # [B, S, Vd]: the logits without the bias
        return [path_tree(p.config, int(c.tokens[-1]), d, _expander(head, normed[b], base[b], int(c.tokens[-1])),
                          head.token_ids)
                for b, (p, c, d) in enumerate(zip(rows, ctxs, draft_depths(rows, ctxs)))]


def _expander(head: DSparkHead, normed: torch.Tensor, base: torch.Tensor, anchor: int) -> Expand:
    """A row's `path_tree` expansion from its slots' normed hidden [block, H] and unbiased logits [S, Vd]."""
    first = head.config.first_slot
    markov = head.markov_head
    after: dict[int, torch.Tensor | None] = {-1: None}  # node -> the recurrent state after its children's slot
    if markov is not None and first:  # the anchor's slot drafts nothing but starts the recurrence, as trained
        after[-1] = markov.mix_step(markov.markov_w1(torch.tensor([anchor], device=normed.device)), normed[:1],
                                    None)[1]

    def expand(node: int, parent: int, token: int, depth: int) -> tuple[torch.Tensor, float | None]:
        slot = normed[first + depth][None]  # [1, H]
        emb = None if markov is None else markov.markov_w1(torch.tensor([token], device=normed.device))  # [1, r]
        logits = base[depth]
        if markov is not None:
            mix, after[node] = markov.mix_step(emb, slot, after[parent])
            logits = logits + markov.markov_w2(mix)[0].float()
        confidence = head.confidence_logits(slot, emb)
        return logits.log_softmax(-1), None if confidence is None else float(confidence.float().sigmoid())

    return expand


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `dspark` method's proposer (`specheads.inference.methods.dspark`)."""
    return build_block_proposer(DSparkProposer, KIND_NAME, target, options)

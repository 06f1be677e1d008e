"""EAGLE rows drafting together: forks of one proposer share a head cache (one row each) and draft in lockstep, one
head forward per level for all; each row's tree must be the one an identical proposer drafts alone, whatever the
rows' depth caps, prompt lengths (long catch-ups feed alone), context vocabularies and stopping levels, across
steps, and after rows leave (the last row moves into the freed one)."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.tree_options import TreeConfig
from specheads.inference.proposers.eagle import EagleProposer
from tests.conftest import random_eagle_head, repetitive_prompt

PROMPT_LENGTHS = (9, 40, 14, 23)  # 40 > the catch-up a batch pads to: that row catches up alone
DEPTHS = (5, 2, 4, 1)


def context(tokens: list[int], depth: int) -> ProposalContext:
    return ProposalContext(tokens=torch.tensor(tokens), num_prompt_tokens=len(tokens), max_depth=depth,
                           sampling=SamplingParams(), generator=None)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            and torch.allclose(a.accept_probs, b.accept_probs, rtol=1e-5, atol=1e-12))


@pytest.mark.parametrize("floor", [0.0, 0.02])
def test_rows_drafting_together_draft_what_each_drafts_alone(target, floor):
    head = random_eagle_head(target, draft_vocab=tuple(range(0, target.config.vocab_size, 2)))  # context vocab in use
    config = TreeConfig(depth=5, topk=3, total_tokens=14)
    template = EagleProposer(head, config, stop_below=lambda: floor)
    together = [template] + [template.fork() for _ in PROMPT_LENGTHS[1:]]
    alone = [EagleProposer(head, config, stop_below=lambda: floor) for _ in PROMPT_LENGTHS]  # a head cache each
    texts = [repetitive_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS, start=3)]
    for rows in (together, alone):
        for p, text in zip(rows, texts):
            hidden = target(torch.tensor([text[:-1]]), output_hidden_states=True).hidden_states
            p.start(context(text, 8), hidden)
    assert len({p.head_rows for p in together}) == 1 and len({p.head_rows for p in alone}) == len(alone)
    for step in range(3):
        ctxs = [context(t, d) for t, d in zip(texts, DEPTHS)]
        trees = EagleProposer.propose_many(together, ctxs)
        for tree, p, ctx in zip(trees, alone, ctxs):
            assert same_tree(tree, p.propose(ctx))
        assert any(t.size > 2 for t in trees)
        # every row "accepts" its first child and the bonus token; the target's states over the verified nodes follow
        for rows in (together, alone):
            for p, text, tree in zip(rows, texts, trees):
                nodes = tree.tokens[: min(2, tree.size)].tolist()
                hidden = target(torch.tensor([text + nodes[1:]]), output_hidden_states=True).hidden_states
                verified = tuple(h[:, len(text) - 1 :] for h in hidden)
                path = torch.arange(len(nodes))
                p.on_verified(VerifyResult(path=path, tokens=torch.tensor(nodes[1:] + [7 + step])), verified)
        for i, tree in enumerate(trees):
            texts[i] = texts[i] + tree.tokens[1: min(2, tree.size)].tolist() + [7 + step]
    # a row leaves: the last row moves into its place, and the others still draft what they draft alone
    together[1].finish()
    assert together[1].row == -1 and sorted(p.row for p in together if p.row >= 0) == [0, 1, 2]
    keep = [0, 2, 3]
    ctxs = [context(texts[i], 5) for i in keep]
    for tree, i, ctx in zip(EagleProposer.propose_many([together[i] for i in keep], ctxs), keep, ctxs):
        assert same_tree(tree, alone[i].propose(ctx))

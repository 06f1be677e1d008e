"""The `dflash2` proposer: the chain it drafts is the selector's greedy choice slot by slot after each drafted token,
computed here by hand; every node's children are its slot's unary top-k ordered by the selector after the node's own
token; the tree never holds more children than candidates; and every variant decodes exactly."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from tests.conftest import repetitive_prompt, start_proposer, tiny_model
from tests.drafters import _dflash2, proposer_for


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@torch.no_grad()
def by_hand(head, target, prompt):
    """The block after `prompt` computed directly: each drafted slot's normed hidden [S, H] and unary logits
    [S, V], and score(prev, d) -> the d-th drafted slot's candidates [k] and selector scores [k] after `prev`."""
    n = len(prompt) - 1
    hs = target(torch.tensor([prompt[:n]]), output_hidden_states=True).hidden_states
    context = head.context_kv(head.select_features(hs), torch.arange(n)[None])
    block = torch.tensor([[prompt[-1]] + [head.config.mask_token_id] * (head.config.block_size - 1)])
    first = head.config.first_slot
    normed = head.norm(head(block, torch.arange(n, n + head.config.block_size)[None], context))[0, first:]
    unary = head.lm_head(normed)
    sel = head.candidate_selector

    @torch.no_grad()
    def score(prev, d):
        ids = unary[d].topk(head.config.selector_top_k).indices
        context = sel.predecessor_codebook[prev] * sel.hidden_projection(normed[d])  # [r]
        return ids, unary[d, ids] + (context[None] * sel.successor_codebook[ids]).sum(-1)

    return unary, score


@pytest.mark.parametrize("settings", [{}, {"sample_from_anchor": True}], ids=["anchor-as-bonus", "from-anchor"])
def test_the_chain_is_the_selectors_greedy_choice_after_each_drafted_token(target, tmp_path, settings):
    head = _dflash2(target, **settings)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("dflash2", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "topk": 1,
                                                          "total_tokens": 10})
    prompt = repetitive_prompt()
    tree = proposer.propose(start_proposer(proposer, target, prompt))
    unary, score = by_hand(head, target, prompt)
    chain, estimates, prev = [prompt[-1]], [1.0], prompt[-1]
    for d in range(head.config.drafted):
        ids, scores = score(prev, d)
        prev = int(ids[scores.argmax()])
        chain.append(prev)
        # the unary top-k's mass, shared out by the selector's softmax
        mass = float(unary[d].softmax(-1)[ids].sum())
        estimates.append(estimates[-1] * mass * float(scores.softmax(-1).max()))
    assert tree.tokens.tolist() == chain and tree.parents.tolist() == list(range(-1, len(chain) - 1))
    assert tree.accept_probs.tolist() == pytest.approx(estimates, rel=1e-4)
    # the selector matters: the unary argmax chain differs
    assert [prompt[-1]] + unary.argmax(-1).tolist() != chain


def test_every_nodes_children_are_ranked_after_its_own_token(target, tmp_path):
    head = _dflash2(target)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("dflash2", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "tree": "eagle2"})
    assert proposer.config.topk == head.config.selector_top_k == 6  # eagle2's 10 children cut to the candidates
    prompt = repetitive_prompt()
    tree = proposer.propose(start_proposer(proposer, target, prompt))
    _, score = by_hand(head, target, prompt)
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    orders = set()
    for node, token in enumerate(tokens):
        children = [tokens[c] for c in range(len(tokens)) if parents[c] == node]
        if not children:
            continue
        ids, scores = score(token, depths[node])
        ranked = ids[scores.argsort(descending=True)].tolist()
        assert children == ranked[: len(children)], node  # best first; never a token outside the candidates
        orders.add((depths[node], tuple(ranked)))
    # two nodes at one depth rank the same candidates differently: each branch reranks after its own token
    assert len(orders) > len({d for d, _ in orders})
    assert len(tokens) == 60 and max(depths) == head.config.drafted


def test_the_estimates_are_draft_probabilities(target, tmp_path):
    save_drafter(tmp_path, _dflash2(target), TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("dflash2", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "tree": "eagle2"})
    tree = proposer.propose(start_proposer(proposer, target, repetitive_prompt()))
    probs, parents = tree.accept_probs.tolist(), tree.parents.tolist()
    for node in range(len(probs)):  # siblings share their parent's probability at most
        children = [probs[c] for c in range(len(probs)) if parents[c] == node]
        assert sum(children) <= probs[node] + 1e-9 and all(0 < p <= 1 for p in children)
    assert math.isclose(probs[0], 1.0)


@pytest.mark.parametrize("settings", [{"sample_from_anchor": True, "conv_kernel_size": 3},
                                      {"conv_kernel_size": 4, "conv_group_size": 64}],
                         ids=["from-anchor-3-taps", "4-taps-one-group"])
def test_every_variant_decodes_exactly(target, tmp_path, settings):
    save_drafter(tmp_path, _dflash2(target, **settings), TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    for values in ({"lookup": 0}, {"tree": "wide"}):
        res = Engine(target, proposer_for("dflash2", target, tmp_path, values)).generate(prompt, max_new_tokens=24)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0, values

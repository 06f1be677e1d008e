"""The `dspark` proposer: trees whose branches each condition on their own previous token (`path_tree`), the chain it
drafts equal to drafting the block token by token by hand, the confidence head's estimates on the nodes, and every
Markov variant and anchor convention decoding exactly."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.methods.tree_options import TreeConfig
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.path_tree import path_tree
from tests.conftest import repetitive_prompt, start_proposer, tiny_model
from tests.drafters import _dspark, proposer_for


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


# After the root (token 1) the drafter prefers 5 then 6; after 5 it prefers 7, after 6 it prefers 8.
NEXT = {1: {5: 0.6, 6: 0.4}, 5: {7: 0.9, 8: 0.1}, 6: {8: 0.8, 7: 0.2}}
CONFIDENCE = {1: 0.5, 5: 0.9, 6: 0.8}


def _expand(calls, confident):
    def expand(node, parent, token, depth):
        calls.append((node, parent, token, depth))
        probs = torch.zeros(11)
        for t, p in NEXT[token].items():
            probs[t] = p
        return probs.clamp(min=1e-9).log(), CONFIDENCE[token] if confident else None
    return expand


def test_each_branch_draws_its_children_from_its_own_token():
    calls = []
    tree = path_tree(TreeConfig(depth=2, topk=2, total_tokens=5), 1, 2, _expand(calls, False), lambda i: i)
    # best-first: 5 (0.6), 5-7 (0.54), 6 (0.4), 6-8 (0.32); the last level is never expanded
    assert tree.tokens.tolist() == [1, 5, 7, 6, 8] and tree.parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.accept_probs.tolist() == pytest.approx([1.0, 0.6, 0.54, 0.4, 0.32])
    assert calls == [(0, -1, 1, 0), (1, 0, 5, 1), (3, 0, 6, 1)]
    # with the confidence: est(child) = est(parent) * c(parent) * q(child) / max q
    confident = path_tree(TreeConfig(depth=2, topk=2, total_tokens=5), 1, 2, _expand([], True), lambda i: i)
    assert confident.tokens.tolist() == tree.tokens.tolist()
    assert confident.accept_probs.tolist() == pytest.approx([1.0, 0.5, 0.45, 0.5 * 0.4 / 0.6, 0.5 * 0.4 / 0.6 * 0.8])
    assert path_tree(TreeConfig(depth=2, topk=2, total_tokens=5, min_expected_accepted=5.0), 1, 2,
                     _expand([], True), lambda i: i).size == 1  # a tree expecting too little: a plain step


@torch.no_grad()
def test_the_chain_is_the_block_drafted_token_by_token(target, tmp_path):
    head = _dspark(target)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("dspark", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "topk": 1,
                                                         "total_tokens": 10})
    prompt = repetitive_prompt()
    tree = proposer.propose(start_proposer(proposer, target, prompt))
    # by hand: the context of every prompt token but the last, the block [last, mask x3] after it
    n = len(prompt) - 1
    hs = target(torch.tensor([prompt[:n]]), output_hidden_states=True).hidden_states
    context = head.context_kv(head.select_features(hs), torch.arange(n)[None])
    block = torch.tensor([[prompt[-1]] + [head.config.mask_token_id] * 3])
    normed = head.norm(head(block, torch.arange(n, n + 4)[None], context))[0]  # [4, H]
    chain, estimate, estimates, prev = [prompt[-1]], 1.0, [1.0], prompt[-1]
    for d in range(4):  # slot d drafts the (d+1)-th next token after the token drafted before it
        emb = head.markov_head.markov_w1(torch.tensor([prev]))
        logits = head.lm_head(normed[d]) + head.markov_head.markov_w2(emb)[0]
        prev = int(head.token_ids(logits.argmax()))
        chain.append(prev)
        estimate *= float(torch.sigmoid(head.confidence_logits(normed[d][None], emb)))
        estimates.append(estimate)
    assert tree.tokens.tolist() == chain and tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert tree.accept_probs.tolist() == pytest.approx(estimates, rel=1e-5)
    # the bias matters: without it the chain differs
    plain = [prompt[-1]] + [int(head.token_ids(head.lm_head(normed[d]).argmax())) for d in range(4)]
    assert plain != chain


@pytest.mark.parametrize("settings", [{"markov_head_type": "gated"},
                                      {"markov_head_type": "rnn", "sample_from_anchor": False},
                                      {"markov_head_type": "rnn"}],
                         ids=["gated", "rnn-anchor-as-bonus", "rnn"])
def test_every_variant_decodes_exactly(target, tmp_path, settings):
    save_drafter(tmp_path, _dspark(target, **settings), TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    for values in ({"lookup": 0}, {"tree": "wide"}):
        res = Engine(target, proposer_for("dspark", target, tmp_path, values)).generate(prompt, max_new_tokens=24)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0, values

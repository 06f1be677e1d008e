"""The `domino` proposer: its slot-by-slot correction is the training forward's teacher-forced logits on the same
tokens (the golden equivalence between training and decoding), along the greedy chain it drafts and along any path;
every node's children are ranked after its own path (each branch carries its own GRU state); and every variant
decodes exactly."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.domino import expander
from specheads.train.block_objective import block_outputs, block_tokens
from tests.conftest import repetitive_prompt, start_proposer, text_batch, tiny_model
from tests.drafters import _domino, proposer_for

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@torch.no_grad()
def training_logits(head, target, prompt, continuation):
    """What training computes for the block anchored at the prompt's last token, the text going on with
    `continuation` (teacher forcing): every slot's refined logits [B, V], and the block's normed outputs [B, H]."""
    text = torch.tensor([prompt + continuation])
    hs = target(text, output_hidden_states=True).hidden_states
    feats = head.select_features(hs)  # [1, T, D]; rows past the anchor are never visible to its block
    anchors = torch.tensor([[len(prompt) - 1]])
    out = block_outputs(head, head, text_batch(text), feats, anchors)[0]  # [1, B, H]
    normed = head.norm(out)
    return head.teacher_forced_logits(normed, block_tokens(text, anchors, BLOCK)[0])[0], normed[0]


@pytest.mark.parametrize("prefix", [0, 1, 3], ids=lambda p: f"pure-prefix-{p}")
def test_the_greedy_chain_is_the_training_forwards_argmax_after_each_drafted_token(target, tmp_path, prefix):
    head = _domino(target, pure_draft_prefix_len=prefix)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("domino", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "topk": 1,
                                                         "total_tokens": 10})
    prompt = repetitive_prompt()
    tree = proposer.propose(start_proposer(proposer, target, prompt))
    chain = tree.tokens.tolist()
    assert tree.parents.tolist() == list(range(-1, BLOCK)) and chain[0] == prompt[-1]  # B tokens from one forward
    logits, normed = training_logits(head, target, prompt, chain[1:])
    assert logits.argmax(-1).tolist() == chain[1:]
    logp = logits.log_softmax(-1)
    path = logp.gather(-1, torch.tensor(chain[1:])[:, None]).flatten().cumsum(0).exp()
    assert tree.accept_probs.tolist() == pytest.approx([1.0, *path.tolist()], rel=1e-4)
    # the correction matters: DFlash's logits alone draft another chain
    if prefix < BLOCK - 1:
        assert head.lm_head(normed).argmax(-1).tolist() != chain[1:]


@torch.no_grad()
def test_the_expansion_along_any_path_is_the_teacher_forced_logits(target):
    head = _domino(target, pure_draft_prefix_len=1)
    prompt = repetitive_prompt()
    path = [17, 40, 3]  # any continuation, drafted or not
    logits, normed = training_logits(head, target, prompt, path)
    expand = expander(head, normed, head.lm_head(normed))
    tokens = [prompt[-1], *path]
    for depth, token in enumerate(tokens):  # node `depth` on the path, its parent the node before
        got = expand(depth, depth - 1, token, depth)[0]
        torch.testing.assert_close(got, logits[depth].log_softmax(-1), rtol=1e-5, atol=1e-5)
    # the previous tokens matter: another path's last slot is corrected otherwise
    other = expander(head, normed, head.lm_head(normed))
    for depth, token in enumerate([prompt[-1], 17, 41, 3]):
        last = other(depth, depth - 1, token, depth)[0]
    assert not torch.allclose(last, logits[3].log_softmax(-1))


def test_every_nodes_children_are_ranked_after_its_own_path(target, tmp_path):
    head = _domino(target)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    proposer = proposer_for("domino", target, tmp_path, {"lookup": 0, "node_budget": "fixed", "tree": "eagle2"})
    prompt = repetitive_prompt()
    tree = proposer.propose(start_proposer(proposer, target, prompt))
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    orders = set()
    for node in range(len(tokens)):
        children = [tokens[c] for c in range(len(tokens)) if parents[c] == node]
        if not children:
            continue
        path, at = [], node
        while at > 0:
            path.insert(0, tokens[at])
            at = parents[at]
        d = depths[node]
        logits, _ = training_logits(head, target, prompt, path + [0] * (BLOCK - 1 - len(path)))
        ranked = logits[d].argsort(descending=True).tolist()
        assert children == ranked[: len(children)], node
        orders.add((d, tuple(ranked[:3])))
    # two nodes at one depth rank differently: each branch is corrected after its own tokens
    assert len(orders) > len({d for d, _ in orders})
    assert len(tokens) == 60 and max(depths) >= 3


@pytest.mark.parametrize("settings", [{"pure_draft_prefix_len": 0}, {"pure_draft_prefix_len": 3}],
                         ids=["corrected-from-slot-0", "corrected-last-slot-only"])
def test_every_variant_decodes_exactly(target, tmp_path, settings):
    save_drafter(tmp_path, _domino(target, **settings), TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    for values in ({"lookup": 0}, {"tree": "wide"}):
        res = Engine(target, proposer_for("domino", target, tmp_path, values)).generate(prompt, max_new_tokens=24)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0, values

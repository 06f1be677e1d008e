"""The P-EAGLE proposer: the tree it builds from a block's distributions, one head forward per step (for a batch of
rows too), the depth limit of the block, and a checkpoint of another kind refused by name."""

from __future__ import annotations

import pytest
import torch

from specheads.inference import Engine
from specheads.inference.proposers.eagle import EagleTreeConfig
from specheads.inference.proposers.peagle import block_tree
from tests.conftest import repetitive_prompt, tiny_model
from tests.drafters import proposer_for, save_case


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_the_tree_holds_the_best_paths_of_the_block():
    # position 0 prefers 5 then 6, position 1 prefers 7 then 8, position 2 prefers 9 then 10
    probs = torch.zeros(3, 11)
    probs[0, [5, 6, 7]] = torch.tensor([0.6, 0.3, 0.1])
    probs[1, [7, 8]] = torch.tensor([0.9, 0.1])
    probs[2, [9, 10]] = torch.tensor([0.6, 0.4])
    logp = probs.clamp(min=1e-9).log()
    tree = block_tree(EagleTreeConfig(depth=3, topk=2, total_tokens=6), 1, logp, lambda i: i)
    # best-first: 5 (0.6), 5-7 (0.54), 5-7-9 (0.324), 6 (0.3), 6-7 (0.27); 5-7-10 (0.216) does not fit
    assert tree.tokens.tolist() == [1, 5, 7, 9, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert tree.accept_probs.tolist() == pytest.approx([1.0, 0.6, 0.54, 0.324, 0.3, 0.27])
    chain = block_tree(EagleTreeConfig(depth=3, topk=1, total_tokens=10), 1, logp, lambda i: i)
    assert chain.tokens.tolist() == [1, 5, 7, 9] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert block_tree(EagleTreeConfig(depth=3, topk=2, total_tokens=6, min_expected_accepted=5.0), 1, logp,
                      lambda i: i).size == 1  # a tree expecting too little: a plain step


def _count_forwards(head):
    calls = []
    handle = head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    return calls, handle


def test_one_head_forward_drafts_the_block_for_every_row(target, tmp_path):
    save_case("peagle", target, tmp_path / "heads")
    proposer = proposer_for("peagle", target, tmp_path / "heads", {"lookup": 0, "node_budget": "fixed"})
    head = proposer.head
    calls, handle = _count_forwards(head)
    try:
        engine = Engine(target, proposer, max_rows=3)
        seqs = [engine.add(repetitive_prompt(seed=s), max_new_tokens=12) for s in (1, 2, 3)]
        engine.step()  # the prefills: no draft yet
        assert calls == []
        engine.step()
        assert len(calls) == 1 and calls[0][0] == 3  # one forward, three rows
        drafted = [s.tree for s in seqs]
        assert all(1 <= int(t.depths.max()) <= head.config.num_depths for t in drafted)
    finally:
        handle.remove()


def test_depth_is_limited_to_the_block(target, tmp_path):
    save_case("peagle", target, tmp_path / "heads")
    with pytest.raises(ValueError, match="draft blocks of 4 tokens; use --depth 4 or less"):
        proposer_for("peagle", target, tmp_path / "heads", {"depth": 5})
    shallow = proposer_for("peagle", target, tmp_path / "heads", {"depth": 2, "lookup": 0, "node_budget": "fixed"})
    engine = Engine(target, shallow)
    seq = engine.add(repetitive_prompt(), max_new_tokens=16)
    depths = []
    while not seq.done:
        engine.step()
        depths.append(int(seq.tree.depths.max()))
    assert max(depths) == 2


def test_heads_of_another_kind_are_refused_by_name(target, tmp_path):
    save_case("eagle3", target, tmp_path / "eagle3")
    with pytest.raises(ValueError, match="holds 'eagle3' heads, not peagle heads; use the method that matches it"):
        proposer_for("peagle", target, tmp_path / "eagle3", {})
    save_case("peagle", target, tmp_path / "peagle")
    with pytest.raises(ValueError, match="holds 'peagle' heads, not eagle3 heads"):
        proposer_for("eagle3", target, tmp_path / "peagle", {})

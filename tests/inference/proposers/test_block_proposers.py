"""The block drafters (`peagle`, `dflash`, `dspark`, `xpress`, `dflash2`, `domino`): the tree built from a block's
distributions, one drafter forward per step for every row (each over its own context), the block's limit on depth,
and checkpoints of another kind refused by name."""

from __future__ import annotations

import pytest
import torch

from specheads.inference import Engine
from specheads.inference.methods.tree_options import TreeConfig
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.block_tree import block_tree
from tests.conftest import repetitive_prompt, tiny_model
from tests.drafters import proposer_for, save_case

# kind: a depth past its block, and its refusal of it
BLOCK_KINDS = {"peagle": (5, "draft blocks of 4 tokens; use --depth 4 or less"),
               "dflash": (4, "fills blocks of 4 .* use --depth 3 or less"),
               "dspark": (5, "fills blocks of 4 .* use --depth 4 or less"),
               "xpress": (4, "fills blocks of 4 .* use --depth 3 or less"),
               "dflash2": (4, "fills blocks of 4 .* use --depth 3 or less"),
               "domino": (5, "fills blocks of 4 .* use --depth 4 or less")}
# their context: every committed token but the last, projected or still pending
CONTEXT_KINDS = ("dflash", "dspark", "xpress", "dflash2", "domino")


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
    tree = block_tree(TreeConfig(depth=3, topk=2, total_tokens=6), 1, logp, lambda i: i)
    # best-first: 5 (0.6), 5-7 (0.54), 5-7-9 (0.324), 6 (0.3), 6-7 (0.27); 5-7-10 (0.216) does not fit
    assert tree.tokens.tolist() == [1, 5, 7, 9, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert tree.accept_probs.tolist() == pytest.approx([1.0, 0.6, 0.54, 0.324, 0.3, 0.27])
    chain = block_tree(TreeConfig(depth=3, topk=1, total_tokens=10), 1, logp, lambda i: i)
    assert chain.tokens.tolist() == [1, 5, 7, 9] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert block_tree(TreeConfig(depth=3, topk=2, total_tokens=6, min_expected_accepted=5.0), 1, logp,
                      lambda i: i).size == 1  # a tree expecting too little: a plain step


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_one_forward_drafts_every_rows_block(kind, target, tmp_path):
    save_case(kind, target, tmp_path / "heads")
    proposer = proposer_for(kind, target, tmp_path / "heads", {"lookup": 0, "node_budget": "fixed"})
    calls = []
    handle = proposer.head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    try:
        engine = Engine(target, proposer, max_rows=3)
        seqs = [engine.add(repetitive_prompt(length=n, seed=n), max_new_tokens=10) for n in (9, 17, 24)]
        engine.step()  # the prefills: no draft yet
        assert calls == []
        for _ in range(3):
            calls.clear()
            engine.step()
            assert len(calls) == 1 and calls[0][0] == 3  # one forward, three rows of different lengths
            assert all(1 <= int(s.tree.depths.max()) <= 4 for s in seqs)
            if kind in CONTEXT_KINDS:
                assert all(s.proposer._length + len(s.proposer._pending) == s.n - 1 for s in seqs)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_depth_is_limited_to_the_block(kind, target, tmp_path):
    save_case(kind, target, tmp_path / "heads")
    too_deep, refusal = BLOCK_KINDS[kind]
    with pytest.raises(ValueError, match=refusal):
        proposer_for(kind, target, tmp_path / "heads", {"depth": too_deep})
    shallow = proposer_for(kind, target, tmp_path / "heads", {"depth": 2, "lookup": 0, "node_budget": "fixed"})
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
    with pytest.raises(ValueError, match="holds 'peagle' heads, not dflash heads"):
        proposer_for("dflash", target, tmp_path / "peagle", {})


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_a_named_chain_drafts_one_guess_per_position(kind, target, tmp_path):
    # `@chainN` (and `chain`: 3) is what chain engines draft: every step's tree a chain of at most N tokens, and the
    # output plain greedy's
    save_case(kind, target, tmp_path)
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    for tree, length in (("chain2", 2), ("chain", 3)):
        proposer = proposer_for(kind, target, tmp_path, {"tree": tree, "lookup": 0, "node_budget": "fixed"})
        seen = []
        engine = Engine(target, proposer)
        verify = engine._verify

        def record(seq, logits, batch, verify=verify, seen=seen):
            seen.append(seq.tree)
            return verify(seq, logits, batch)

        engine._verify = record
        res = engine.generate(prompt, max_new_tokens=24)
        assert res.output_ids == plain.output_ids, (kind, tree)
        drafted = [t for t in seen if t.size > 1]
        assert drafted and all(t.is_chain and t.size - 1 <= length for t in drafted), (kind, tree)
        assert max(t.size - 1 for t in drafted) == length, (kind, tree)

"""Medusa proposer in the engine: greedy output equals plain greedy; sampling runs; tree bookkeeping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss
from specheads.inference import Engine, SamplingParams
from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.medusa import MEDUSA_TREES, MedusaProposer, load_medusa_proposer
from tests.conftest import repetitive_prompt, tiny_model

MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(target):
    prompt = repetitive_prompt()
    return prompt, Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids


def random_heads(target, num_heads: int = 4, seed: int = 0) -> MedusaHeads:
    """Heads whose ResBlocks are perturbed away from identity: plausible but mostly wrong guesses."""
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=num_heads), target.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return heads.eval()


def memorising_heads(target, prompt: list[int], continuation: list[int], steps: int = 10) -> MedusaHeads:
    """Heads briefly fit to the target's own greedy text: good by construction, so drafts get accepted.

    Ten steps leave them right most of the time but not always, so steps mix full and partial acceptance.
    """
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=3), target.get_output_embeddings())
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, _ = medusa_loss(heads(hidden), ids, torch.ones_like(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


def ctx(tokens: list[int], max_depth: int = 8) -> ProposalContext:
    return ProposalContext(tokens=torch.tensor(tokens), num_prompt_tokens=len(tokens), max_depth=max_depth,
                           sampling=SamplingParams(), generator=None)


def test_tree_is_built_from_head_topk(target):
    heads = random_heads(target, num_heads=2)
    tree = [[0], [1], [0, 0], [0, 2], [1, 0]]
    proposer = MedusaProposer(heads, tree)
    hidden = torch.randn(1, 5, 64)
    proposer.start(ctx([7, 8, 9]), (hidden,))
    topk = heads(hidden[:, -1:])[:, 0, 0].topk(3).indices  # [2, 3]
    draft = proposer.propose(ctx([7, 8, 9]))
    assert draft.tokens.tolist() == [9, topk[0, 0], topk[0, 1], topk[1, 0], topk[1, 2], topk[1, 0]]
    assert draft.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert draft.draft_probs is None
    # A depth cap keeps the breadth-first prefix; a fresh structure is checked against DraftTree's own.
    capped = proposer.propose(ctx([7, 8, 9], max_depth=1))
    assert capped.tokens.tolist() == draft.tokens[:3].tolist() and capped.max_depth == 1
    assert proposer.propose(ctx([7, 8, 9], max_depth=0)).size == 1
    assert torch.equal(draft.ancestors, type(draft)(tokens=draft.tokens, parents=draft.parents).ancestors)


def test_one_token_prompt_proposes_root_only(target):
    proposer = MedusaProposer(random_heads(target), MEDUSA_TREES["medusa-16"])
    proposer.start(ctx([5]), None)
    assert proposer.propose(ctx([5])).size == 1


def test_tree_deeper_than_heads_is_rejected(target):
    with pytest.raises(ValueError, match="4 deep but the checkpoint has 2 medusa heads"):
        MedusaProposer(random_heads(target, num_heads=2), MEDUSA_TREES["chain-4"])


@pytest.mark.parametrize("arch,tree", [("llama", "chain-4"), ("llama", "medusa-16"), ("qwen2", "medusa-63")])
def test_random_heads_match_plain_greedy(arch, tree):
    target = tiny_model(arch)
    prompt = repetitive_prompt()
    expected = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids
    res = Engine(target,
                 MedusaProposer(random_heads(target), MEDUSA_TREES[tree])).generate(prompt, max_new_tokens=MAX_NEW)
    assert res.output_ids == expected
    assert res.stats.drafted > 0 and res.stats.new_tokens == MAX_NEW


def test_good_heads_get_accepted_and_match_plain_greedy(target, reference, tmp_path):
    prompt, expected = reference
    heads = memorising_heads(target, prompt, expected)
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    save_drafter(tmp_path, heads, TargetInfo.from_model(target, "tiny"), config=replace(heads.config, tree=tree))
    proposer = load_medusa_proposer(tmp_path, target)  # the tree stored with the heads
    assert proposer.paths == tree
    res = Engine(target, proposer).generate(prompt, max_new_tokens=MAX_NEW)
    assert res.output_ids == expected
    assert res.stats.accepted > 0 and res.stats.steps < MAX_NEW, res.stats.to_dict()
    assert len(res.stats.accept_per_position) >= 2, res.stats.to_dict()  # multi-token paths committed


def test_load_with_tree_override_and_default(target, tmp_path):
    save_drafter(tmp_path, random_heads(target, num_heads=2), TargetInfo.from_model(target, "tiny"))
    assert load_medusa_proposer(tmp_path, target).depth == 2  # no stored tree: medusa-16 pruned to the 2 heads
    assert load_medusa_proposer(tmp_path, target, tree="medusa-32", max_depth=1).paths == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="use a tree at most 2 deep"):
        load_medusa_proposer(tmp_path, target, tree="chain-4")


def test_sampling_smoke(target):
    prompt = repetitive_prompt()
    sampling = SamplingParams(temperature=1.0, seed=0)
    engine = Engine(target, MedusaProposer(random_heads(target), MEDUSA_TREES["medusa-16"]))
    first = engine.generate(prompt, max_new_tokens=20, sampling=sampling)
    again = engine.generate(prompt, max_new_tokens=20, sampling=sampling)
    assert len(first.output_ids) == 20 and first.stats.drafted > 0
    assert all(0 <= t < 96 for t in first.output_ids)
    assert again.output_ids == first.output_ids  # seeded


def test_rows_drafting_together_get_the_trees_each_drafts_alone(target):
    """`propose_many` runs the heads once over every row's state; each row's tree is the one its own `propose` gives."""
    import copy

    from specheads.inference.engine.proposer import propose_rows
    from specheads.inference.engine.sampling import SamplingParams
    from specheads.inference.engine.tree import DraftTree
    from specheads.inference.engine.verifier import VerifyResult

    template = MedusaProposer(random_heads(target), MEDUSA_TREES["medusa-16"])
    hidden = target(torch.tensor([repetitive_prompt(12)]), output_hidden_states=True).hidden_states
    ctxs = [ProposalContext(tokens=torch.tensor([5, 6, 7 + i]), num_prompt_tokens=2, max_depth=depth,
                            sampling=SamplingParams(), generator=None) for i, depth in enumerate((4, 2, 3))]

    def rows() -> list[MedusaProposer]:  # three rows, each having seen another position's state
        out = []
        for i in range(3):
            p = copy.copy(template)
            p.on_verified(VerifyResult(path=torch.tensor([i]), tokens=torch.tensor([1])), hidden)
            out.append(p)
        return out

    together = propose_rows(rows(), ctxs)
    alone = [p.propose(c) for p, c in zip(rows(), ctxs)]
    assert len({tuple(t.tokens.tolist()) for t in together}) == 3  # the rows' trees differ
    for a, b in zip(together, alone):
        assert isinstance(a, DraftTree) and torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.allclose(a.accept_probs, b.accept_probs)

"""The `xpress` proposer: the refiner's bias computed by hand, the Jacobi passes it drafts with (each reading the
argmax of the pass before, the token before the anchor in the anchor's slot), their fixed point equal to drafting the
block slot by slot, rows drafting together as each drafts alone, and both anchor conventions decoding exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from tests.conftest import repetitive_prompt, start_proposer, tiny_model
from tests.drafters import _xpress, proposer_for


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def bias_by_hand(head, normed, prev):
    """The module doc's formulas slot by slot: the bias [k, Vd] of the block's first k slots from every slot's normed
    output [B, H] (the summary is the whole block's) and those slots' previous tokens [k]."""
    ref = head.refiner_head
    summary = normed.mean(0)
    a = torch.stack([ref.in_proj(torch.cat([ref.down_h(normed[s]), ref.down_g(summary), ref.token_embed(prev[s])]))
                     for s in range(len(prev))])  # [k, r]
    out = []
    for s in range(len(prev)):
        c = a[s] + sum(ref.mix_l[:, s, j] * a[j] for j in range(s + 1))
        u = c + ref.mlp_down(F.silu(ref.mlp_gate(c)) * ref.mlp_up(c))
        out.append(ref.readout(u))
    return torch.stack(out)


def block_by_hand(head, target, prompt):
    """The normed outputs [4, H] of the block [last, mask x3] after the context of every prompt token but the last."""
    n = len(prompt) - 1
    hs = target(torch.tensor([prompt[:n]]), output_hidden_states=True).hidden_states
    context = head.context_kv(head.select_features(hs), torch.arange(n)[None])
    block = torch.tensor([[prompt[-1]] + [head.config.mask_token_id] * 3])
    return head.norm(head(block, torch.arange(n, n + 4)[None], context))[0]


def chain(target, folder, prompt, **values):
    proposer = proposer_for("xpress", target, folder, {"lookup": 0, "node_budget": "fixed", "topk": 1,
                                                       "total_tokens": 10, **values})
    return proposer.propose(start_proposer(proposer, target, prompt)).tokens.tolist()


@pytest.mark.parametrize("anchored", [False, True], ids=["anchor-as-bonus", "from-anchor"])
@torch.no_grad()
def test_the_chain_is_the_last_jacobi_pass_over_the_block(target, tmp_path, anchored):
    head = _xpress(target, sample_from_anchor=anchored, num_jacobi_passes=2)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt()
    normed = block_by_hand(head, target, prompt)
    base = head.lm_head(normed)  # [4, Vd]
    ids = lambda logits: [int(head.token_ids(i)) for i in logits.argmax(-1)]  # noqa: E731
    first = 0 if anchored else 1
    drafted = ids(base)  # pass 0: the block without the bias
    for _ in range(2):
        # the tokens at the block's positions: the anchor, then the drafts; each slot reads the one before its own
        # (from the anchor: slot s drafts x_{n+s+1} after x_{n+s}; as the bonus: slot s drafts x_{n+s} after
        # x_{n+s-1}, the anchor's slot reading the token before the anchor)
        at = [prompt[-1]] + (drafted[:-1] if anchored else drafted[1:])
        prev = torch.tensor(at if anchored else [prompt[-2]] + at[:-1])
        logits = base + bias_by_hand(head, normed, prev)
        drafted = ids(logits)
    assert chain(target, tmp_path, prompt) == [prompt[-1]] + drafted[first:]
    # the refiner matters: without the passes the chain is the block's own argmax
    plain = [prompt[-1]] + ids(base)[first:]
    assert chain(target, tmp_path, prompt) != plain
    save_drafter(tmp_path / "none", _xpress(target, sample_from_anchor=anchored, num_jacobi_passes=0),
                 TargetInfo.from_model(target, "tiny"))
    assert chain(target, tmp_path / "none", prompt) == plain


@pytest.mark.parametrize("anchored", [False, True], ids=["anchor-as-bonus", "from-anchor"])
@torch.no_grad()
def test_enough_passes_reach_the_block_drafted_slot_by_slot(target, tmp_path, anchored):
    # the bias of slot s reads the previous tokens of slots <= s only, so pass s fixes slot s for good: after a pass
    # per slot the block is what drafting one slot at a time gives, and further passes change nothing
    head = _xpress(target, sample_from_anchor=anchored, num_jacobi_passes=4)
    save_drafter(tmp_path, head, TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt(seed=3)
    normed = block_by_hand(head, target, prompt)
    base = head.lm_head(normed)
    first = 0 if anchored else 1
    prev = [prompt[-1]] if anchored else [prompt[-2], prompt[-1]]
    drafted = []
    for s in range(first, 4):
        logits = base[: s + 1] + bias_by_hand(head, normed, torch.tensor(prev))
        drafted.append(int(head.token_ids(logits[s].argmax())))
        prev.append(drafted[-1])
    assert chain(target, tmp_path, prompt) == [prompt[-1]] + drafted
    # the proposer's passes stop at the fixed point: asking for more changes nothing
    resolved = head.resolve(normed[None], base[None], torch.tensor([prompt[-1]]), torch.tensor([prompt[-2]]))
    torch.testing.assert_close(resolved, head.resolve(normed[None], base[None], torch.tensor([prompt[-1]]),
                                                      torch.tensor([prompt[-2]]), passes=12))


@torch.no_grad()
def test_rows_draft_together_as_each_drafts_alone(target, tmp_path):
    save_drafter(tmp_path, _xpress(target), TargetInfo.from_model(target, "tiny"))
    values = {"lookup": 0, "node_budget": "fixed"}
    prompts = [repetitive_prompt(length=n, seed=n) for n in (9, 17, 24)]
    alone = []
    for prompt in prompts:
        proposer = proposer_for("xpress", target, tmp_path, values)
        alone.append(proposer.propose(start_proposer(proposer, target, prompt)))
    rows = [proposer_for("xpress", target, tmp_path, values) for _ in prompts]
    ctxs = [start_proposer(p, target, prompt) for p, prompt in zip(rows, prompts)]
    together = type(rows[0]).propose_many(rows, ctxs)
    for a, b in zip(alone, together):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        torch.testing.assert_close(a.accept_probs, b.accept_probs)
    assert len({tuple(t.tokens.tolist()) for t in together}) == 3


@pytest.mark.parametrize("settings", [{"sample_from_anchor": True}, {"num_jacobi_passes": 0}, {"xpress_mlp_ratio": 4}],
                         ids=["from-anchor", "no-passes", "mlp-ratio-4"])
def test_every_variant_decodes_exactly(target, tmp_path, settings):
    save_drafter(tmp_path, _xpress(target, **settings), TargetInfo.from_model(target, "tiny"))
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    for values in ({"lookup": 0}, {"tree": "wide"}):
        res = Engine(target, proposer_for("xpress", target, tmp_path, values)).generate(prompt, max_new_tokens=24)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0, values

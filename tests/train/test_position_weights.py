"""Loss weights over a block's slots: D-PACE against speculators' own and by hand, decay as DFlash's, accept-until-fail
on the cases speculators' own tests pin; the heads recipes train with every loss and weighting offered."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.train.divergence import HEAD_LOSSES
from specheads.train.objective import OBJECTIVES
from specheads.train.position_weights import PositionWeighting, acceptance, decay_weights, dpace_weights, until_fail
from tests.conftest import tiny_model
from tests.test_families import few_steps


def test_dpace_by_hand():
    confidence = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = dpace_weights(confidence, mask, alpha=0.0)
    # certain slots: slot j is followed by every later one, 3, 2, 1; halves: 1/2 + 1/4 for the first, 1/4 for the
    # second, nothing for the slot that does not count
    torch.testing.assert_close(got, torch.tensor([[3.0, 2.0, 1.0], [0.75, 0.25, 0.0]]))
    torch.testing.assert_close(dpace_weights(confidence, mask, alpha=1.0),  # fully smoothed: counts of what follows
                               torch.tensor([[3.0, 2.0, 1.0], [2.0, 1.0, 0.0]]))


@pytest.mark.interop
def test_dpace_and_decay_are_speculators_weights():
    utils = pytest.importorskip("speculators.losses.utils", reason="scripts/setup.sh installs speculators")
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.2).long()
    theirs = utils.dpace_loss_decay(None, loss_mask=mask.reshape(1, -1), block_size=5, dpace_alpha=0.3,
                                    elementwise_loss=-confidence.log().reshape(1, -1))  # their confidence: exp(-CE)
    torch.testing.assert_close(dpace_weights(confidence, mask, 0.3).reshape(1, -1), theirs, rtol=1e-5, atol=1e-6)
    slot = torch.arange(1, 8)
    torch.testing.assert_close(decay_weights(slot, 4.0), utils.dflash_loss_decay(slot, 4.0))


def test_acceptance_is_the_overlap_of_the_two_distributions():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    assert float(acceptance(p.log(), q.log())) == pytest.approx(0.5)
    assert float(acceptance(p.log(), p.log())) == pytest.approx(1.0)


def _support(drafted: list[int], wanted: list[int], counted: list[bool]) -> list[bool]:
    blocks = torch.tensor([counted])
    agree = torch.tensor(drafted)[blocks[0]] == torch.tensor(wanted)[blocks[0]]
    return until_fail(blocks, agree)[0].tolist()


def test_until_fail_keeps_each_block_through_its_first_failure():
    # the cases of speculators' accept-until-fail tests (their PR #773): the failing slot keeps its loss, every later
    # one loses it; a slot that does not count is no failure and stays out
    every = [True] * 4
    assert _support([1, 2, 9, 4], [1, 2, 3, 4], every) == [True, True, True, False]
    assert _support([9, 2, 3, 4], [1, 2, 3, 4], every) == [True, False, False, False]
    assert _support([1, 2, 3, 9], [1, 2, 3, 4], every) == every
    assert _support([1, 2, 3, 4], [1, 2, 3, 4], every) == every
    assert _support([1, 9, 3, 4], [1, 2, 3, 4], [True, False, True, True]) == [True, False, True, True]
    blocks = torch.tensor([[True, True, True], [True, True, False]])  # blocks apart: the second's failure is its own
    agree = torch.tensor([True, False, True, False, True])
    assert until_fail(blocks, agree).tolist() == [[True, True, False], [True, False, False]]


def test_accept_until_fail_cuts_any_weighting_at_the_failure():
    blocks = torch.ones(2, 3, dtype=torch.bool)
    target = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0, 1, 2]), 4).float()
    draft = torch.nn.functional.one_hot(torch.tensor([0, 3, 2, 0, 1, 3]), 4).float()  # block 0 fails at its slot 2
    decay = PositionWeighting(position_weighting="decay", position_decay=1.0, accept_until_fail=True)
    expected = torch.exp(-torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 2.0])) * torch.tensor([1, 1, 0, 1, 1, 1])
    torch.testing.assert_close(decay.weights(blocks, target, draft), expected)
    agree = target.argmax(-1) == draft.argmax(-1)  # given instead of computed: the same
    torch.testing.assert_close(decay.weights(blocks, target, draft, agree), expected)
    uniform = PositionWeighting(position_weighting="uniform", accept_until_fail=True)
    assert not uniform.all_alike and PositionWeighting(position_weighting="uniform").all_alike
    assert uniform.weights(blocks, target, draft).tolist() == [1, 1, 0, 1, 1, 1]


CASES = [("eagle3", loss, {}) for loss in HEAD_LOSSES] + [
    ("peagle", "nla", {}), ("dflash", "lk", {}), ("dflash", "cross_entropy", {"position_weighting": "dpace"}),
    ("peagle", "cross_entropy", {"position_weighting": "dpace"}), ("peagle", "tv", {"position_weighting": "decay"}),
    ("peagle", "cross_entropy", {"accept_until_fail": True}),
    ("dflash", "cross_entropy", {"accept_until_fail": True})]


@pytest.mark.parametrize(("recipe", "loss", "extra"), CASES)
def test_the_fused_heads_train_with_every_loss_and_weighting(recipe, loss, extra):
    losses = few_steps(recipe, tiny_model("llama"), aux_layers=(1, 2, 3), loss=loss, **extra)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (recipe, loss, losses)


@pytest.mark.parametrize(("settings", "message"), [
    ({"loss": "kl"}, "heads.loss 'kl' is unknown; use one of: cross_entropy, forward_kl"),
    ({"position_weighting": "linear"}, "heads.position_weighting must be one of uniform, decay, dpace"),
    ({"dpace_alpha": 0.0}, r"heads.dpace_alpha must be in \(0, 1\]"),
])
def test_bad_loss_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        OBJECTIVES.get("dflash").settings(aux_layers=(1, 2, 3), **settings)


def test_peagle_entries_get_their_own_blocks_weights():
    # entries listed depth by depth, as P-EAGLE's forward lists them, weighted as their anchors' blocks say
    from specheads.train.peagle import PEagleHeadsConfig, _weighted

    settings = PEagleHeadsConfig(aux_layers=(1, 2, 3), position_weighting="decay", position_decay=1.0)
    anchor = torch.tensor([0, 1, 2, 0, 2, 0])  # depth 0 at anchors 0-2, depth 1 at 0 and 2, depth 2 at 0
    depth = torch.tensor([0, 0, 0, 1, 1, 2])
    valid = torch.ones(1, 6, dtype=torch.bool)
    ce = torch.arange(1.0, 7.0)
    logits = torch.zeros(6, 4)
    rows = torch.zeros(6, dtype=torch.long)
    got, _ = _weighted(ce, settings, valid, rows, anchor, depth, 3, 3, logits, logits)
    w = torch.exp(-depth.float())  # slot d + 1 weighs exp(-d)
    torch.testing.assert_close(got, (w * ce).sum() / w.sum())
    # accept-until-fail: anchor 0 fails at depth 1 (entry 3), so its depth 2 (entry 5) is cut; anchor 2's depth 1 is
    # right, and nothing else fails
    auf = PEagleHeadsConfig(aux_layers=(1, 2, 3), position_weighting="decay", position_decay=1.0,
                            accept_until_fail=True)
    agree = torch.tensor([True, False, True, False, True, True])  # anchor 1's failure at depth 0 cuts nothing trained
    got, weights = _weighted(ce, auf, valid, rows, anchor, depth, 3, 3, logits, logits, agree)
    kept = w * torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(weights, kept)
    torch.testing.assert_close(got, (kept * ce).sum() / kept.sum())

"""The P-EAGLE objective: conditional drop-token sampling, the block mask, and every trained entry computing exactly
what the drafter computes at inference (the committed pairs, then mask entries, causally)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from specheads.heads.fused_head import default_mask_token
from specheads.heads.peagle import PEagleConfig, PEagleHead
from specheads.train.chain_loss import unroll
from specheads.train.peagle import (
    PEagleHeadsConfig,
    ar_unroll,
    block_eval,
    block_forward,
    block_mask,
    build_peagle,
    cod_anchors,
    peagle_eval_row,
    peagle_step_loss,
)
from tests.conftest import tiny_model
from tests.drafters import perturbed


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture
def head(target):  # not the identity, so wrong attention shows in the outputs
    return perturbed(build_peagle(PEagleHeadsConfig(aux_layers=(1, 2, 3), num_layers=2, num_depths=4), target), seed=1)


def test_cod_keeps_every_anchor_at_depth_0_and_nested_shrinking_subsets_deeper():
    g = torch.Generator().manual_seed(0)
    anchors = cod_anchors(100, 5, ratio=0.5, floor=0.2, generator=g)
    assert torch.equal(anchors[0], torch.arange(100))
    for d in range(1, 5):
        pool = int((anchors[d - 1] < 100 - d).sum())  # deeper chains grow from the shallower ones
        assert anchors[d].numel() == min(pool, math.ceil((100 - d) * max(0.5 ** d, 0.2)))
        assert bool((anchors[d] < 100 - d).all()) and set(anchors[d].tolist()) <= set(anchors[d - 1].tolist())
        assert torch.equal(anchors[d], anchors[d].sort().values)
    full = cod_anchors(6, 3, ratio=1.0, floor=1.0)
    assert [a.tolist() for a in full] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [0, 1, 2, 3]]


def test_block_mask_sees_the_causal_context_and_its_own_chain():
    anchor = torch.tensor([0, 1, 2, 3, 1, 3, 1])
    depth = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    visible = block_mask(anchor, depth, torch.float32)[0, 0] == 0
    assert visible[4].nonzero().flatten().tolist() == [0, 1, 4]  # (1, 1): anchors 0-1 at depth 0, itself
    assert visible[6].nonzero().flatten().tolist() == [0, 1, 4, 6]  # (1, 2): and its chain's depth-1 entry
    assert visible[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]  # (3, 1): not the other chain
    assert visible[2].nonzero().flatten().tolist() == [0, 1, 2]  # depth 0 is causal


@torch.no_grad()
def test_every_trained_entry_is_what_inference_computes(head):
    tokens = torch.randint(3, 90, (2, 12))
    feats = torch.randn(2, 12, head.feature_width)
    anchors = cod_anchors(12, 4, ratio=0.6, floor=0.3, generator=torch.Generator().manual_seed(3))
    out, anchor, depth = block_forward(head, head, tokens, feats, anchors)
    mask_feat = head.mask_features()
    for i in range(0, anchor.numel(), 3):
        a, d = int(anchor[i]), int(depth[i])
        # inference: the pairs up to the anchor, then d mask entries, one causal forward from position 0
        tok = torch.cat([tokens[:, : a + 1], torch.full((2, d), head.config.mask_token_id)], dim=1)
        feat = torch.cat([feats[:, : a + 1], mask_feat.expand(2, d, -1)], dim=1)
        seq = head(tok, feat, torch.arange(a + 1 + d).expand(2, -1))
        torch.testing.assert_close(out[:, i], seq[:, -1], rtol=1e-4, atol=1e-5)


def test_the_loss_trains_every_depth_and_the_mask_hidden(target, head):
    tokens = torch.randint(3, 96, (2, 16))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    head.train()
    loss, stats = peagle_step_loss(head, target, batch, PEagleHeadsConfig(num_depths=4))
    assert math.isfinite(float(loss)) and {"top1", "top1_depth1", "top1_depth3", "loss_ce"} <= stats.keys()
    loss.backward()
    assert head.mask_hidden.grad is not None and float(head.mask_hidden.grad.abs().sum()) > 0
    assert target.get_input_embeddings().weight.grad is None  # the target's embedding stays frozen


def test_eval_counts_every_anchor_at_every_depth(target, head):
    tokens = torch.randint(3, 96, (2, 10))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    sums = block_eval(head.eval(), target, batch)
    assert sums["positions"].tolist() == [2 * (9 - d) for d in range(4)]  # W = 9 pairs, depth d: W - d anchors
    assert bool((sums["correct_top1"] <= sums["correct_topk"]).all())
    assert 0 <= float(sums["accepted"][0]) <= 4 * float(sums["starts"][0])


@torch.no_grad()
def test_the_chain_mode_after_a_block_is_eagle3s_unroll(head):
    """The unrolled steps see the block's depth-0 keys and never its mask entries: exactly EAGLE-3's training-time
    test (tested against inference in test_eagle), whatever entries the block sampled."""
    tokens = torch.randint(3, 90, (2, 12))
    feats = torch.randn(2, 12, head.feature_width)
    positions = torch.arange(12).expand(2, -1)
    anchors = cod_anchors(12, 4, ratio=0.6, floor=0.3, generator=torch.Generator().manual_seed(5))
    cache = DynamicCache()
    out, anchor, _ = block_forward(head, head, tokens, feats, anchors, cache)
    chain = ar_unroll(head, tokens, out[:, :12], anchor.numel(), cache, steps=3)
    reference = unroll(head, tokens, feats, positions, steps=3)
    torch.testing.assert_close(out[:, :12], reference[0], rtol=1e-4, atol=1e-5)
    for got, want in zip(chain, reference[1:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_chain_mode_term_adds_its_steps_to_the_loss(target, head):
    tokens = torch.randint(3, 96, (2, 16))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    torch.manual_seed(0)
    block, _ = peagle_step_loss(head, target, batch, PEagleHeadsConfig(num_depths=4))
    torch.manual_seed(0)
    off, _ = peagle_step_loss(head, target, batch, PEagleHeadsConfig(num_depths=4, ar_steps=3, ar_weight=0.0))
    torch.testing.assert_close(off, block)  # weight 0: the block's loss alone
    torch.manual_seed(0)
    loss, stats = peagle_step_loss(head, target, batch, PEagleHeadsConfig(num_depths=4, ar_steps=3))
    assert {"top1_ar2", "top1_ar3", "loss_ce_ar2", "loss_ce_ar3"} <= stats.keys()
    # the mean of the block's loss and its two steps'
    want = (block + stats["loss_ce_ar2"] + stats["loss_ce_ar3"]) / 3
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    head.zero_grad()
    loss.backward()
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_eval_reports_the_chain_mode_beside_the_block(target, head):
    tokens = torch.randint(3, 96, (2, 10))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    sums = block_eval(head.eval(), target, batch)
    assert float(sums["ar_correct_top1"][0]) == float(sums["correct_top1"][0])  # step 0 is the block's depth 0
    assert sums["ar_positions"].tolist() == sums["positions"].tolist()
    row, _ = peagle_eval_row(sums)
    assert row["eval/top1_ar_step1"] == row["eval/top1_step1"]
    assert 1.0 <= row["eval/simulated_tau_ar_chain"] <= 5.0 and "eval/simulated_tau_chain" in row


def test_bad_block_settings_are_refused_by_name(target):
    vocab = target.get_output_embeddings().weight.shape[0]
    base = {"hidden_size": 64, "vocab_size": vocab, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="mask_token_id 96 is outside"):
        PEagleConfig(**base, mask_token_id=vocab)
    with pytest.raises(ValueError, match="num_depths must be >= 1"):
        PEagleConfig(**base, num_depths=0)
    with pytest.raises(ValueError, match="does not fit the target's context"):
        PEagleHead(PEagleConfig(**base, num_depths=10 ** 6), target)
    with pytest.raises(ValueError, match="heads.num_depths"):
        PEagleHeadsConfig(num_depths=0)
    with pytest.raises(ValueError, match="down_sample_ratio"):
        PEagleHeadsConfig(down_sample_ratio=0.0)
    with pytest.raises(ValueError, match="heads.ar_steps must be >= 1"):
        PEagleHeadsConfig(ar_steps=0)
    assert 0 <= default_mask_token(target) < vocab

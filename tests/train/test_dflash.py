"""The DFlash objective: anchors, the block mask, and every trained slot computing exactly what the drafter computes
at inference (the context rows before the anchor, then the block)."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.heads.dflash import DFlashConfig, DFlashHead
from specheads.train.dflash import (
    DFlashHeadsConfig,
    _blocks,
    anchor_candidates,
    block_inputs,
    build_dflash,
    dflash_eval,
    dflash_step_loss,
    sample_anchors,
)
from tests.conftest import text_batch, tiny_model
from tests.drafters import perturbed


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture
def head(target):  # not the identity, so wrong attention shows in the outputs
    return perturbed(build_dflash(DFlashHeadsConfig(aux_layers=(1, 2, 3), num_layers=2, block_size=4), target), seed=1)


def test_anchors_fit_the_sequence_and_start_answers():
    counts = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    ok = anchor_candidates(counts, block=3)
    # the block a..a+2 fits in positions 0..7 and x_{a+1} counts: a in 1..5
    assert ok[0].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    torch.manual_seed(0)
    anchors, real = sample_anchors(ok.expand(2, -1).clone(), count=3)
    assert anchors.shape == (2, 3) and bool(real.all())
    assert all(set(row.tolist()) <= {1, 2, 3, 4, 5} and row.tolist() == sorted(row.tolist()) for row in anchors)
    few, real = sample_anchors(torch.tensor([[False, True, False, False]]), count=3)
    assert few.tolist() == [[1]] and real.tolist() == [[True]]


def test_block_mask_sees_the_context_before_the_anchor_and_its_whole_block(head):
    anchors = torch.tensor([[2, 5]])
    tokens, positions, mask = block_inputs(head, torch.arange(10)[None], anchors, torch.ones(1, 10, dtype=torch.bool))
    mask_id = head.config.mask_token_id
    assert tokens.tolist() == [[2, mask_id, mask_id, mask_id, 5, mask_id, mask_id, mask_id]]
    assert positions.tolist() == [[2, 3, 4, 5, 5, 6, 7, 8]]
    visible = mask[0, 0] == 0  # [8, 10 + 8]
    assert visible[1].nonzero().flatten().tolist() == [0, 1, 10, 11, 12, 13]  # anchor 2: context 0-1, its block
    assert visible[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 14, 15, 16, 17]


@torch.no_grad()
def test_every_trained_slot_is_what_inference_computes(head):
    tokens = torch.randint(3, 90, (2, 12))
    feats = torch.randn(2, 12, head.feature_width)
    anchors = torch.tensor([[1, 4, 8], [0, 3, 6]])
    drafted = _blocks(head, head, text_batch(tokens), feats, anchors)  # [2, 3, 3, H]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            # inference: context rows 0..a-1, then [x_a, mask, mask, mask] at a..a+3, no mask
            context = head.context_kv(feats[b : b + 1, :a], torch.arange(a)[None]) if a else \
                [(torch.zeros(1, layer.self_attn.kv_heads, 0, layer.self_attn.head_dim),) * 2 for layer in head.layers]
            block = torch.tensor([[int(tokens[b, a])] + [head.config.mask_token_id] * 3])
            out = head(block, torch.arange(a, a + 4)[None], context)
            torch.testing.assert_close(drafted[b, i], out[0, 1:], rtol=1e-4, atol=1e-5)


def test_the_loss_trains_every_slot(target, head):
    tokens = torch.randint(3, 96, (2, 16))
    head.train()
    loss, stats = dflash_step_loss(head, target, text_batch(tokens, answer_from=2), DFlashHeadsConfig(block_size=4))
    assert math.isfinite(float(loss)) and {"top1", "top1_pos2", "top1_pos3", "loss_ce"} <= stats.keys()
    loss.backward()
    assert head.fc.weight.grad is not None and float(head.layers[0].self_attn.k_norm.weight.grad.abs().sum()) > 0


def test_eval_counts_every_anchor(target, head):
    tokens = torch.randint(3, 96, (2, 10))
    sums = dflash_eval(head.eval(), target, text_batch(tokens))
    assert float(sums["starts"][0]) == 2 * 7  # anchors 0..6 fit a block of 4 in 10 tokens
    assert sums["positions"].tolist() == [14.0, 14.0, 14.0]
    assert 0 <= float(sums["accepted"][0]) <= 3 * 14


def test_bad_block_settings_are_refused_by_name(target):
    vocab = target.get_output_embeddings().weight.shape[0]
    base = {"hidden_size": 64, "vocab_size": vocab, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashConfig(**base, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id 96 is outside"):
        DFlashConfig(**base, mask_token_id=vocab)
    with pytest.raises(ValueError, match="does not fit the target's context"):
        DFlashHead(DFlashConfig(**base, block_size=10 ** 6), target)
    with pytest.raises(ValueError, match="aux_layers"):
        DFlashHead(DFlashConfig(hidden_size=64, vocab_size=vocab, aux_layers=(1, 9)), target)
    with pytest.raises(ValueError, match="heads.block_size"):
        DFlashHeadsConfig(block_size=0)

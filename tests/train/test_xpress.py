"""The XPress objective: each slot's previous token (the token before the anchor included), the teacher-forced refiner
and the trained Jacobi passes exactly as decoding computes them, the loss's three terms and their weights, the
evaluation drafting as decoding does, and bad settings refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.heads.xpress import XPressConfig
from specheads.train.block_objective import block_outputs, block_step, tokens_before
from specheads.train.features import batch_features, last_layer
from specheads.train.xpress import XPressHeadsConfig, build_xpress, xpress_blocks, xpress_eval, xpress_step_loss
from tests.conftest import text_batch, tiny_model
from tests.drafters import _xpress


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def test_previous_tokens_follow_the_anchor_convention(target):
    text, before = torch.tensor([[10, 11, 12, 13]]), torch.tensor([9])  # x_a .. x_{a+3}, x_{a-1}
    # the anchor as the bonus token: slot s drafts x_{a+s} after x_{a+s-1}; the anchor's slot reads x_{a-1}
    assert _xpress(target).previous_tokens(text, before).tolist() == [[9, 10, 11, 12]]
    # from the anchor: slot s drafts x_{a+s+1} after x_{a+s}
    assert _xpress(target, sample_from_anchor=True).previous_tokens(text, before).tolist() == [[10, 11, 12, 13]]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert tokens_before(ids, torch.tensor([[0, 1, 4]])).tolist() == [[5, 5, 8]]  # the anchor itself at the start


@pytest.mark.parametrize("anchored", [False, True], ids=["anchor-as-bonus", "from-anchor"])
@torch.no_grad()
def test_every_trained_block_is_what_decoding_computes(target, anchored):
    head = _xpress(target, sample_from_anchor=anchored)
    tokens = torch.randint(3, 90, (1, 14))
    torch.manual_seed(0)
    step = block_step(head, target, text_batch(tokens), max_anchors=3, feature_noise=0.0)
    blocks = xpress_blocks(step, tokens, passes=3)
    assert len(blocks.passes) == 3
    normed = head.norm(step.outputs)[0]  # [n, 4, H]
    for i, a in enumerate(step.anchors[0].tolist()):
        base = head.lm_head(normed[i])
        torch.testing.assert_close(blocks.base[0, i], base)
        # teacher forced: the text's previous tokens, x_{a-1} (x_a at the start) in front without sample_from_anchor
        at = torch.arange(a, a + 4).clamp(max=13)
        before = tokens[0, max(a - 1, 0)]
        prev = tokens[0, at] if anchored else torch.cat([before[None], tokens[0, at[:-1]]])
        cache = head.refiner_head.hidden_cache(normed[i][None])
        torch.testing.assert_close(blocks.teacher_forced[0, i], base + head.refiner_head(cache, prev[None])[0])
        # pass j: decoding's j-th Jacobi pass
        for j in range(3):
            want = head.resolve(normed[i][None], base[None], tokens[0, a][None], before[None], passes=j + 1)[0]
            torch.testing.assert_close(blocks.passes[j][0, i], want)


def test_the_loss_is_its_three_terms_weighted(target):
    head = _xpress(target).train()
    tokens = torch.randint(3, 96, (2, 16))
    batch = text_batch(tokens, answer_from=2)

    def run(**settings):
        torch.manual_seed(0)
        return xpress_step_loss(head, target, batch, XPressHeadsConfig(block_size=4, **settings))

    loss, stats = run()
    assert {"top1", "top1_pos2", "top1_pos3", "loss_teacher_forced", "loss_consistency", "loss_base_anchor",
            "top1_base"} <= stats.keys()
    want = stats["loss_teacher_forced"] + 0.3 * stats["loss_consistency"] + 0.6 * stats["loss_base_anchor"]
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    ref = head.refiner_head
    for p in (head.fc.weight, head.lm_head.weight, ref.token_embed.weight, ref.down_g.weight, ref.mix_l,
              ref.readout.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    alone, alone_stats = run(consistency_weight=0.0, base_anchor_weight=0.0)
    assert float(alone.detach()) == pytest.approx(stats["loss_teacher_forced"], rel=1e-5)
    assert "loss_consistency" not in alone_stats and "loss_base_anchor" not in alone_stats
    assert "loss_consistency" not in run(consistency_passes=0)[1]
    # the anchor term at full weight weighs every slot alike: another value than the decayed one
    full = run(base_anchor_full_weight=True)[1]["loss_base_anchor"]
    assert full != pytest.approx(stats["loss_base_anchor"], rel=1e-4)
    assert math.isfinite(full)


@torch.no_grad()
def test_eval_drafts_as_decoding_does(target):
    head = _xpress(target)
    batch = text_batch(torch.randint(3, 96, (2, 10)))
    sums = xpress_eval(head, target, batch)
    assert float(sums["starts"][0]) == 2 * 7  # anchors 0..6 leave room for x_{a+3} in 10 tokens
    assert sums["positions"].tolist() == [14.0] * 3
    # by hand: each anchor's block resolved by the Jacobi passes, its drafts against the target's argmax
    features = batch_features(target, batch, head.config.aux_layers)
    wanted = target.get_output_embeddings()(last_layer(features, head.config.hidden_size)).argmax(-1)  # [2, 10]
    hits, plain_hits = torch.zeros(3), torch.zeros(3)
    for row in range(2):
        ids = batch["input_ids"][row]
        one = {k: v[row : row + 1] for k, v in batch.items()}
        for a in range(7):
            normed = head.norm(block_outputs(head, head, one, features[row : row + 1], torch.tensor([[a]]))[0, 0])
            base = head.lm_head(normed)
            resolved = head.resolve(normed[None], base[None], ids[a][None], ids[max(a - 1, 0)][None])[0]
            hits += (head.token_ids(resolved[1:].argmax(-1)) == wanted[row, a : a + 3]).float()
            plain_hits += (head.token_ids(base[1:].argmax(-1)) == wanted[row, a : a + 3]).float()
    assert sums["correct_top1"].tolist() == hits.tolist()
    assert hits.tolist() != plain_hits.tolist()  # the passes change what is drafted


def test_a_fresh_drafter_is_built_from_the_recipe(target):
    head = build_xpress(XPressHeadsConfig(aux_layers=(1, 2, 3), block_size=4, xpress_rank=4, xpress_mlp_ratio=3),
                        target)
    ref = head.refiner_head
    assert ref.mix_l.shape == (4, 4, 4) and bool((ref.mix_l == 0).all())
    assert ref.mlp_gate.weight.shape == (12, 4) and ref.readout.weight.shape == (head.config.draft_vocab_size, 4)
    assert ref.token_embed.weight.shape[0] == head.config.vocab_size
    assert float(ref.readout.weight.detach().std()) == pytest.approx(0.02, rel=0.2)


def test_bad_settings_are_refused_by_name():
    base = {"hidden_size": 64, "vocab_size": 96, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="xpress_rank must be >= 1"):
        XPressConfig(**base, xpress_rank=0)
    with pytest.raises(ValueError, match="xpress_mlp_ratio must be >= 1"):
        XPressConfig(**base, xpress_mlp_ratio=0)
    with pytest.raises(ValueError, match="num_jacobi_passes must be >= 0"):
        XPressConfig(**base, num_jacobi_passes=-1)
    with pytest.raises(ValueError, match="heads.consistency_weight must be >= 0"):
        XPressHeadsConfig(consistency_weight=-0.1)
    with pytest.raises(ValueError, match="heads.consistency_passes must be >= 0"):
        XPressHeadsConfig(consistency_passes=-1)
    with pytest.raises(ValueError, match="heads.base_anchor_weight must be >= 0"):
        XPressHeadsConfig(base_anchor_weight=-1.0)
    with pytest.raises(ValueError, match="heads.xpress_rank"):
        XPressHeadsConfig(xpress_rank=0)

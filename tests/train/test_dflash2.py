"""The DFlash2 objective: the convolutions stay inside each block (training's blocks side by side are the blocks
decoding runs alone), a fresh drafter's layers are DFlash's, the selector's training candidates and teacher-forced
scores, its k-way loss and its weight in the step, evaluation's ranking, and bad settings refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specheads.heads.dflash import DFlashConfig, DFlashHead
from specheads.heads.dflash2 import DFlash2Config, DFlash2Head
from specheads.train.block_objective import block_outputs, block_step
from specheads.train.config import load_train_config
from specheads.train.dflash2 import (
    DFlash2HeadsConfig,
    build_dflash2,
    dflash2_eval,
    dflash2_step_loss,
    reranked,
    selector_candidates,
    selector_loss,
    teacher_forced,
)
from specheads.train.position_weights import decay_weights
from tests.conftest import text_batch, tiny_model
from tests.drafters import _dflash2


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def _no_context(head):
    return [(torch.zeros(1, layer.self_attn.kv_heads, 0, layer.self_attn.head_dim),) * 2 for layer in head.layers]


@torch.no_grad()
def test_training_blocks_side_by_side_are_the_blocks_decoding_runs_alone(target):
    head = _dflash2(target, conv_kernel_size=3)
    tokens = torch.randint(3, 90, (2, 12))
    feats = torch.randn(2, 12, head.feature_width)
    anchors = torch.tensor([[1, 4, 7], [0, 3, 6]])
    out = block_outputs(head, head, text_batch(tokens), feats, anchors)  # [2, 3, 4, H]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            context = head.context_kv(feats[b : b + 1, :a], torch.arange(a)[None]) if a else _no_context(head)
            block = torch.tensor([[int(tokens[b, a])] + [head.config.mask_token_id] * 3])
            alone = head(block, torch.arange(a, a + 4)[None], context)[0]  # [4, H]
            torch.testing.assert_close(out[b, i], alone, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_the_convolution_is_causal_within_the_block(target):
    head = _dflash2(target, conv_kernel_size=2)
    conv = head.layers[0].attention_conv
    u = torch.randn(1, 8, 64)  # two blocks of 4
    base, kernels = conv.prepare(u)
    moved = u.clone()
    moved[0, 1] += 1.0  # block 0, slot 1
    after, _ = conv.prepare(moved)
    changed = (after - base).abs().amax(-1)[0] > 1e-6
    # slot 1 reads itself and slot 0; slot 2 reads slot 1 (two taps); nothing reaches block 1
    assert changed.tolist() == [False, True, True, False, False, False, False, False]
    # by hand: slot s = (W[0] + z_s[0]) u_s + (W[1] + z_s[1]) u_{s-1}, per channel group (16 channels each)
    z = conv.kernel_projection(u).view(1, 8, 2, 2, 4)[0, :, 0]  # [8, K, G]: the input side's token kernels
    w = conv.base_kernel[0]  # [K, H]
    s = 2
    want = (w[0] + z[s, 0].repeat_interleave(16)) * u[0, s] + (w[1] + z[s, 1].repeat_interleave(16)) * u[0, s - 1]
    torch.testing.assert_close(base[0, s], want)
    torch.testing.assert_close(base[0, 4], (w[0] + z[4, 0].repeat_interleave(16)) * u[0, 4])  # a block's first slot


@torch.no_grad()
def test_a_fresh_drafter_has_dflash_layers(target):
    fresh = build_dflash2(DFlash2HeadsConfig(aux_layers=(1, 2, 3), block_size=4, selector_rank=4), target)
    dflash = DFlashHead(DFlashConfig(hidden_size=64, vocab_size=96, aux_layers=(1, 2, 3), block_size=4,
                                     mask_token_id=fresh.config.mask_token_id), target)
    shared = {k: v for k, v in fresh.state_dict().items() if k in dflash.state_dict()}
    dflash.load_state_dict(shared)
    assert len(shared) == len(dflash.state_dict())
    torch.manual_seed(0)
    tokens = torch.randint(3, 90, (1, 10))
    feats = torch.randn(1, 10, fresh.feature_width)
    anchors = torch.tensor([[2, 5]])
    torch.testing.assert_close(block_outputs(fresh, fresh, text_batch(tokens), feats, anchors),
                               block_outputs(dflash, dflash, text_batch(tokens), feats, anchors))
    # its LM head is the target's own, frozen (and never saved)
    assert torch.equal(fresh.lm_head.weight, target.lm_head.weight) and not fresh.lm_head.weight.requires_grad


def test_the_label_replaces_the_last_candidate_only_where_the_top_k_misses_it():
    top = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    candidates, place, recalled = selector_candidates(top, torch.tensor([6, 9, 7]))
    assert candidates.tolist() == [[5, 6, 7], [5, 6, 9], [5, 6, 7]]
    assert place.tolist() == [1, 2, 2] and recalled.tolist() == [True, False, True]


def test_the_selector_is_trained_on_the_texts_previous_tokens_against_the_targets_choice(target):
    head = _dflash2(target)
    tokens = torch.randint(3, 90, (1, 14))
    torch.manual_seed(0)
    step = block_step(head, target, text_batch(tokens), max_anchors=3, feature_noise=0.0)
    entries = teacher_forced(step, tokens)
    sel = head.candidate_selector
    normed = head.norm(step.outputs)  # [1, n, 4, H]
    m = 0
    for i, a in enumerate(step.anchors[0].tolist()):
        for d in range(3):  # slot d + 1 drafts x_{a+d+1}, after x_{a+d}
            if not step.valid[0, i, d]:
                continue
            h = normed[0, i, d + 1]
            unary = head.lm_head(h)
            ids = unary.topk(6).indices
            label = int(step.target_logits[m].argmax())
            if label not in ids.tolist():
                ids[-1] = label
            context = sel.predecessor_codebook[tokens[0, a + d]] * sel.hidden_projection(h)
            want = unary[ids] + (context[None] * sel.successor_codebook[ids]).sum(-1)
            assert entries.candidates[m].tolist() == ids.tolist()
            assert int(entries.candidates[m, entries.label[m]]) == label
            torch.testing.assert_close(entries.scores[m], want, rtol=1e-4, atol=1e-5)
            m += 1
    assert m == entries.scores.shape[0] > 0


def test_the_selector_loss_is_k_way_cross_entropy_with_the_slot_weights(target):
    head = _dflash2(target)
    tokens = torch.randint(3, 90, (2, 16))
    torch.manual_seed(0)
    step = block_step(head, target, text_batch(tokens, answer_from=2), max_anchors=4, feature_noise=0.0)
    entries = teacher_forced(step, tokens)
    ce = F.cross_entropy(entries.scores.float(), entries.label, reduction="none")
    slot = torch.arange(1, 4).expand_as(step.valid)[step.valid]
    w = decay_weights(slot, 4.0)
    got = selector_loss(step, entries, DFlash2HeadsConfig())
    assert float(got.detach()) == pytest.approx(float((w * ce).detach().sum() / w.sum()), rel=1e-5)
    # under dpace the confidences are the selector's probability of the label
    dpace = selector_loss(step, entries, DFlash2HeadsConfig(position_weighting="dpace")).detach()
    assert float(dpace) != pytest.approx(float(got.detach()), rel=1e-3)


def test_the_step_trains_layers_convolutions_and_selector_not_the_lm_head(target):
    head = _dflash2(target).train()
    tokens = torch.randint(3, 96, (2, 16))
    settings = DFlash2HeadsConfig(block_size=4, selector_loss_alpha=0.5)
    loss, stats = dflash2_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
    assert math.isfinite(float(loss.detach()))
    assert {"top1", "top1_pos2", "top1_pos3", "loss_ce", "loss_selector", "candidate_recall"} <= stats.keys()
    loss.backward()
    for p in (head.fc.weight, head.layers[0].attention_conv.base_kernel,
              head.layers[1].mlp_conv.kernel_projection.weight, head.candidate_selector.predecessor_codebook,
              head.candidate_selector.successor_codebook, head.candidate_selector.hidden_projection.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    assert head.lm_head.weight.grad is None
    without = DFlash2HeadsConfig(block_size=4, selector_loss_alpha=0.0)
    torch.manual_seed(0)
    a, _ = dflash2_step_loss(head, target, text_batch(tokens, answer_from=2), without)
    torch.manual_seed(0)
    b, s = dflash2_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
    assert float((b - a).detach()) == pytest.approx(0.5 * s["loss_selector"], rel=1e-4)


@torch.no_grad()
def test_eval_ranks_the_candidates_by_the_selector_above_the_rest(target):
    head = _dflash2(target)
    out, prev = torch.randn(3, 64), torch.tensor([5, 6, 7])
    keys = reranked(head, out, prev)  # [3, V]
    normed = head.norm(out)
    unary = head.lm_head(normed)
    ids, scores = head.candidates(unary, normed, prev)
    order = keys.argsort(-1, descending=True)
    assert order[:, :6].tolist() == ids.gather(-1, scores.argsort(-1, descending=True)).tolist()
    rest = order[:, 6:]
    assert bool((unary.gather(-1, rest).diff(dim=-1) <= 0).all())  # then the others by unary logit
    sums = dflash2_eval(head, target, text_batch(torch.randint(3, 96, (2, 10))))
    assert float(sums["starts"][0]) == 2 * 7  # anchors 0..6 leave room for x_{a+3} in 10 tokens
    assert sums["positions"].tolist() == [14.0] * 3 and 0 <= float(sums["accepted"][0]) <= 3 * 14


def test_bad_settings_are_refused_by_name(target):
    base = {"hidden_size": 64, "vocab_size": 96, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="set draft_vocab_size: null in the recipe"):
        DFlash2Config(**base, draft_vocab=tuple(range(3, 80)))
    with pytest.raises(ValueError, match="conv_group_size 24 does not divide the hidden size 64"):
        DFlash2Config(**base, conv_group_size=24)
    with pytest.raises(ValueError, match="selector_top_k 100 exceeds the target vocabulary"):
        DFlash2Config(**base, selector_top_k=100)
    with pytest.raises(ValueError, match="conv_kernel_size 5 reaches past a block of 4 slots"):
        DFlash2Config(**base, block_size=4, conv_kernel_size=5)
    with pytest.raises(ValueError, match="dflash2 selector_rank must be >= 1"):
        DFlash2HeadsConfig(selector_rank=0)
    with pytest.raises(ValueError, match="heads.selector_loss_alpha must be >= 0"):
        DFlash2HeadsConfig(selector_loss_alpha=-1.0)
    with pytest.raises(ValueError, match="recipe dflash2 scores the target's whole vocabulary .* set "
                                         "draft_vocab_size: null"):
        load_train_config(None, ["recipe=dflash2"])
    assert load_train_config(None, ["recipe=dflash2", "draft_vocab_size=null"]).draft_vocab_size is None
    assert isinstance(DFlash2Head(DFlash2Config(**base, block_size=4), target), DFlash2Head)

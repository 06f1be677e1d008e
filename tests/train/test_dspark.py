"""The DSpark objective: which token is each slot's previous one, the Markov bias conditioned on it (teacher forced)
exactly as decoding computes it, the confidence head's loss against the acceptance rate, and the whole step."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.heads.dspark import DSparkConfig, DSparkHead
from specheads.train.block_objective import anchor_candidates, block_outputs, block_step
from specheads.train.dspark import (
    DSparkHeadsConfig,
    build_dspark,
    confidence_loss,
    dspark_eval,
    dspark_step_loss,
    teacher_forced,
)
from tests.conftest import text_batch, tiny_model
from tests.drafters import _dspark


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def test_previous_tokens_follow_the_anchor_convention(target):
    text = torch.tensor([[10, 11, 12, 13]])  # x_a .. x_{a+3}
    # drafting from the anchor's slot: slot s drafts x_{a+s+1}, after x_{a+s}
    assert _dspark(target).previous_tokens(text).tolist() == [[10, 11, 12, 13]]
    # the anchor as the bonus token: slot s >= 1 drafts x_{a+s}, after x_{a+s-1}; slot 0 gets the anchor
    assert _dspark(target, sample_from_anchor=False).previous_tokens(text).tolist() == [[10, 10, 11, 12]]
    counts = torch.ones(1, 10, dtype=torch.bool)
    # a block of 4 drafts x_{a+1}..x_{a+4} from its anchor's slot (a <= 5), x_{a+1}..x_{a+3} otherwise (a <= 6)
    assert anchor_candidates(counts, 4, first_slot=0)[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert anchor_candidates(counts, 4, first_slot=1)[0].nonzero().flatten().tolist() == list(range(7))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@torch.no_grad()
def test_the_markov_bias_depends_on_the_previous_token_only_where_it_is_read(target, kind):
    head = _dspark(target, markov_head_type=kind)
    hidden = torch.randn(1, 4, 64)
    prev = torch.tensor([[5, 6, 7, 8]])
    base, _ = head.block_logits(hidden, prev)
    changed = prev.clone()
    changed[0, 2] = 40
    other, _ = head.block_logits(hidden, changed)
    moved = (other - base).abs().amax(-1)[0]  # [4]
    assert float(moved[2]) > 1e-3 and bool((moved[:2] == 0).all())
    # the recurrence carries the change to later slots; the other variants read one token a slot
    assert (float(moved[3]) > 1e-3) == (kind == "rnn")
    if kind == "vanilla":  # B = W1 W2ᵀ: the bias is the previous token's row of it
        bias = head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
        torch.testing.assert_close(base, head.lm_head(head.norm(hidden)) + bias)
    # teacher forcing over the block = decoding slot by slot, the state carried along
    normed = head.norm(hidden)
    state = None
    for s in range(4):
        emb = head.markov_head.markov_w1(prev[:, s])
        mix, state = head.markov_head.mix_step(emb, normed[:, s], state)
        torch.testing.assert_close(base[:, s], head.slot_logits(normed[:, s], mix))


@torch.no_grad()
def test_every_trained_slot_is_what_decoding_computes(target):
    head = _dspark(target)
    tokens = torch.randint(3, 90, (2, 12))
    batch = text_batch(tokens)
    feats = torch.randn(2, 12, head.feature_width)
    anchors = torch.tensor([[1, 4, 7], [0, 3, 6]])
    out = block_outputs(head, head, batch, feats, anchors)  # [2, 3, 4, H]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            context = head.context_kv(feats[b : b + 1, :a], torch.arange(a)[None]) if a else \
                [(torch.zeros(1, layer.self_attn.kv_heads, 0, layer.self_attn.head_dim),) * 2 for layer in head.layers]
            block = torch.tensor([[int(tokens[b, a])] + [head.config.mask_token_id] * 3])
            alone = head(block, torch.arange(a, a + 4)[None], context)[0]  # [4, H]
            torch.testing.assert_close(out[b, i], alone, rtol=1e-4, atol=1e-5)
            # slot d drafts x_{a+d+1} after x_{a+d}: the bias of the text's token there
            logits, confidence = head.block_logits(alone[None], tokens[b, a : a + 4][None])
            normed = head.norm(alone)
            emb = head.markov_head.markov_w1(tokens[b, a : a + 4])
            want = head.lm_head(normed) + head.markov_head.markov_w2(emb)
            torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(confidence[0], head.confidence_head.proj(torch.cat([normed, emb], -1))[:, 0])


def test_the_step_reads_the_texts_previous_tokens(target):
    head = _dspark(target)
    tokens = torch.randint(3, 90, (1, 14))
    torch.manual_seed(0)
    step = block_step(head, target, text_batch(tokens), max_anchors=3, feature_noise=0.0)
    logits, confidence = teacher_forced(step, tokens)
    assert logits.shape == (int(step.valid.sum()), head.config.draft_vocab_size)
    assert confidence.shape == logits.shape[:1]
    normed = head.norm(step.outputs)  # [1, n, 4, H]
    m = 0
    for i, a in enumerate(step.anchors[0].tolist()):
        for d in range(4):
            if step.valid[0, i, d]:
                prev = tokens[0, a + d]
                want = head.lm_head(normed[0, i, d]) + head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
                torch.testing.assert_close(logits[m], want, rtol=1e-4, atol=1e-5)
                m += 1
    assert m == logits.shape[0]


def test_the_confidence_loss_is_cross_entropy_against_the_acceptance_rate():
    # p = (1/2, 1/2, 0), q = (1, 0, 0): one draft from q is accepted with Σ min(p, q) = 1/2
    target_logits = torch.tensor([[0.0, 0.0, -1e4], [0.0, -1e4, -1e4]])
    draft_logits = torch.tensor([[1e4, 0.0, 0.0], [1e4, 0.0, 0.0]])
    confidence = torch.tensor([0.0, 2.0], requires_grad=True)
    depth = torch.tensor([0, 1])
    loss, accept = confidence_loss(confidence, target_logits, draft_logits, depth, gamma=4.0)
    torch.testing.assert_close(accept, torch.tensor([0.5, 1.0]))
    bce = [math.log(2.0), -math.log(1 / (1 + math.exp(-2.0)))]  # target 1/2 at logit 0; target 1 at logit 2
    want = (bce[0] + math.exp(-1 / 4.0) * bce[1]) / 2
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert float(confidence.grad[0]) == pytest.approx(0.0, abs=1e-6)  # sigmoid(0) is already the rate


def test_the_loss_trains_the_drafter_the_bias_and_the_confidence_head(target):
    head = _dspark(target).train()
    tokens = torch.randint(3, 96, (2, 16))
    settings = DSparkHeadsConfig(block_size=4, confidence_head_alpha=0.5)
    loss, stats = dspark_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
    assert math.isfinite(float(loss))
    assert {"top1", "top1_pos2", "top1_pos3", "top1_pos4", "loss_ce", "loss_confidence", "confidence_error"} \
        <= stats.keys()
    loss.backward()
    for p in (head.fc.weight, head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight,
              head.confidence_head.proj.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    without = DSparkHeadsConfig(block_size=4, confidence_head_alpha=0.0)
    torch.manual_seed(0)
    a, _ = dspark_step_loss(head, target, text_batch(tokens, answer_from=2), without)
    torch.manual_seed(0)
    b, s = dspark_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
    assert float(b - a) == pytest.approx(0.5 * s["loss_confidence"], rel=1e-4)


def test_a_fresh_drafter_drafts_as_the_dflash_drafter_it_extends(target):
    head = build_dspark(DSparkHeadsConfig(aux_layers=(1, 2, 3), block_size=4, markov_rank=4), target)
    hidden, prev = torch.randn(1, 4, 64), torch.randint(0, 96, (1, 4))
    with torch.no_grad():
        logits, _ = head.block_logits(hidden, prev)
        torch.testing.assert_close(logits, head.draft_logits(hidden))  # W2 starts at zero


def test_eval_counts_every_slot_of_every_anchor(target):
    head = _dspark(target)
    sums = dspark_eval(head, target, text_batch(torch.randint(3, 96, (2, 10))))
    assert float(sums["starts"][0]) == 2 * 6  # anchors 0..5 leave room for x_{a+4} in 10 tokens
    assert sums["positions"].tolist() == [12.0] * 4
    assert 0 <= float(sums["accepted"][0]) <= 4 * 12


def test_bad_settings_are_refused_by_name(target):
    base = {"hidden_size": 64, "vocab_size": 96, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="markov_head_type must be one of vanilla, gated, rnn"):
        DSparkConfig(**base, markov_head_type="lstm")
    with pytest.raises(ValueError, match="markov_rank must be >= 0"):
        DSparkConfig(**base, markov_rank=-1)
    with pytest.raises(ValueError, match="confidence_head_with_markov needs"):
        DSparkConfig(**base, markov_rank=0)
    bare = DSparkConfig(**base, markov_rank=0, confidence_head_with_markov=False)
    assert DSparkHead(bare, target).markov_head is None
    with pytest.raises(ValueError, match="heads.confidence_head_alpha must be >= 0"):
        DSparkHeadsConfig(confidence_head_alpha=-1.0)
    with pytest.raises(ValueError, match="heads.markov_head_type"):
        DSparkHeadsConfig(markov_head_type="lstm")

"""Medusa heads: identity start, loss shifts and training, checkpoint roundtrip."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specheads.formats.load import load_heads
from specheads.heads.checkpoint import WEIGHTS_NAME, TargetInfo, save_drafter, save_heads
from specheads.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss
from tests.conftest import TINY_VOCAB, tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2)


@pytest.fixture(scope="module")
def hidden(target):
    ids = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return ids, out.hidden_states[-1]  # [2, 24, 64], after the final norm


def perturb(heads: MedusaHeads, scale: float = 0.05, seed: int = 0) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


def test_fresh_shared_heads_equal_target_lm_head(target, hidden):
    _, h = hidden
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=3, num_layers=2), target.get_output_embeddings())
    logits = heads(h)
    assert logits.shape == (3, 2, 24, TINY_VOCAB)
    for k in range(3):
        torch.testing.assert_close(logits[k], target.lm_head(h))
    assert heads(h, num_heads=1).shape == (1, 2, 24, TINY_VOCAB)


def test_own_lm_head_starts_as_target_copy_and_trains(target, hidden):
    _, h = hidden
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=2, own_lm_head=True), target.get_output_embeddings())
    for head in heads.lm_heads:
        torch.testing.assert_close(head.weight, target.lm_head.weight)
        assert head.weight.requires_grad and head.weight.data_ptr() != target.lm_head.weight.data_ptr()
    torch.testing.assert_close(heads(h)[1], target.lm_head(h))
    assert not target.lm_head.weight.requires_grad


def test_loss_pairs_head_k_with_token_t_plus_k_plus_2():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    num_heads, length, vocab = 3, 6, 12
    logits = torch.full((num_heads, 1, length, vocab), -20.0)
    for k in range(num_heads):
        for t in range(length - k - 2):
            logits[k, 0, t, ids[0, t + k + 2]] = 20.0  # a perfect head
    loss, acc = medusa_loss(logits, ids, torch.ones_like(ids))
    assert loss.item() < 1e-6 and acc == [1.0, 1.0, 1.0]
    # Masking every target token of head 2 (positions >= 4) leaves it without data.
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    _, acc = medusa_loss(logits, ids, mask)
    assert acc[:2] == [1.0, 1.0] and math.isnan(acc[2])
    # Wrong predictions everywhere: CE = decay-weighted sum over the heads.
    loss, acc = medusa_loss(torch.zeros(num_heads, 1, length, vocab), ids, torch.ones_like(ids), decay=0.5)
    assert loss.item() == pytest.approx(math.log(vocab) * (1 + 0.5 + 0.25), rel=1e-5)
    assert acc == [0.0, 0.0, 0.0]


def test_loss_decreases_with_training(target, hidden):
    ids, h = hidden
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=3), target.get_output_embeddings())
    params = [p for p in heads.parameters() if p.requires_grad]
    assert all(p.data_ptr() != target.lm_head.weight.data_ptr() for p in params)  # the shared head stays frozen
    opt = torch.optim.Adam(params, lr=1e-2)
    mask = torch.ones_like(ids)
    losses = []
    for _ in range(30):
        loss, _ = medusa_loss(heads(h), ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_save_load_roundtrip(tmp_path, target, hidden, own_lm_head):
    _, h = hidden
    cfg = MedusaConfig.for_target(target, num_heads=2, num_layers=2, own_lm_head=own_lm_head)
    heads = perturb(MedusaHeads(cfg, target.get_output_embeddings()))
    save_drafter(tmp_path, heads, TargetInfo.from_model(target, "tiny"), config=replace(cfg, tree=[[0, 0], [0], [1]]))
    loaded = load_heads(tmp_path, target)
    assert loaded.config == replace(cfg, tree=((0,), (1,), (0, 0))) and isinstance(loaded, MedusaHeads)
    with torch.no_grad():
        torch.testing.assert_close(loaded(h), heads(h), rtol=0, atol=0)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / WEIGHTS_NAME)
    assert not any(k.startswith("target_lm_head") for k in saved)
    assert any(k.startswith("lm_heads") for k in saved) == own_lm_head


def test_loading_rejects_other_targets_and_kinds(tmp_path, target):
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=1), target.get_output_embeddings())
    save_drafter(tmp_path / "m", heads, TargetInfo.from_model(target, "tiny"))
    assert load_heads(tmp_path / "m", target, kind="medusa").config.tree is None
    wider = tiny_model("llama", layers=2, vocab=128)
    with pytest.raises(ValueError, match=r"vocabulary 96 \(heads\) vs 128 \(target\)"):
        load_heads(tmp_path / "m", wider)
    save_heads(tmp_path / "e", heads, kind="eagle", config={}, target=TargetInfo.from_model(target, "tiny"))
    with pytest.raises(ValueError, match="'eagle' heads, not medusa"):
        load_heads(tmp_path / "e", target, kind="medusa")


def test_config_validation(target):
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        MedusaConfig(hidden_size=64, vocab_size=96, num_heads=0)
    with pytest.raises(ValueError, match="has no parent"):
        MedusaConfig(hidden_size=64, vocab_size=96, tree=[[0, 0]])
    with pytest.raises(ValueError, match="for_target"):
        MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=96), target.get_output_embeddings())


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_draft_vocabulary_scores_only_its_tokens_and_roundtrips(tmp_path, target, hidden, own_lm_head):
    _, h = hidden
    vocab = (3, 7, 8, 20, 50, 95)
    cfg = MedusaConfig.for_target(target, num_heads=2, own_lm_head=own_lm_head, draft_vocab=list(vocab))
    heads = MedusaHeads(cfg, target.get_output_embeddings())
    logits = heads(h)
    assert logits.shape == (2, 2, 24, len(vocab)) and cfg.draft_vocab == vocab  # a list becomes a tuple
    torch.testing.assert_close(logits[0], target.lm_head(h)[..., list(vocab)])  # fresh heads: the target's rows
    assert heads.token_ids(torch.tensor([0, 5])).tolist() == [3, 95]
    save_drafter(tmp_path, perturb(heads), TargetInfo.from_model(target, "tiny"))
    loaded = load_heads(tmp_path, target)
    assert loaded.config == heads.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(h), heads(h), rtol=0, atol=0)


def test_loss_over_a_draft_vocabulary_counts_unscorable_targets_as_misses():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    draft = torch.tensor([7, 9, 10])  # 8 is not scored: head 0's target at t=1
    logits = torch.full((1, 1, 6, 3), -20.0)
    for t, tok in enumerate([7, 8, 9, 10]):
        if tok in draft:
            logits[0, 0, t, (draft == tok).nonzero()] = 20.0
    loss, acc = medusa_loss(logits, ids, torch.ones_like(ids), draft_ids=draft)
    assert loss.item() < 1e-6  # the scorable targets are predicted perfectly
    assert acc == [0.75]  # 3 of the 4 targets; the unscorable one is a miss


def test_draft_vocabulary_must_be_sorted_distinct_ids():
    with pytest.raises(ValueError, match="draft_vocab must be sorted, distinct token ids in \\[0, 96\\)"):
        MedusaConfig(hidden_size=64, vocab_size=96, draft_vocab=(5, 3))
    with pytest.raises(ValueError, match="draft_vocab"):
        MedusaConfig(hidden_size=64, vocab_size=96, draft_vocab=(5, 96))

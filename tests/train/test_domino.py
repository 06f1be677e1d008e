"""The Domino objective: the GRU is torch's own (the reference implementations'), a fresh drafter's logits are
DFlash's (with the target's frozen LM head), λ's schedule over the share of the run the recipe hands it (never saved
with the drafter), the loss by hand, AUF on the base branch only, the loss falling
in a few steps, evaluation's sums, and bad settings refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from specheads.formats.load import load_heads
from specheads.heads.domino import DominoConfig, DominoHead
from specheads.train.__main__ import main as train_main
from specheads.train.block_objective import block_outputs, block_step
from specheads.train.config import load_train_config
from specheads.train.domino import (
    DominoHeadsConfig,
    build_domino,
    domino_eval,
    domino_step_loss,
)
from specheads.train.features import batch_features, last_layer
from tests.conftest import base_args, text_batch, tiny_model
from tests.drafters import _domino


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@torch.no_grad()
def test_the_prefix_gru_is_torchs_gru(target):
    head = _domino(target)
    gru = head.domino_head.prefix_gru
    ref = torch.nn.GRU(64, 16, num_layers=1, batch_first=True, bias=False)
    ref.load_state_dict(gru.state_dict())  # the same names, so the same layout a speculators checkpoint holds
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(gru(x), ref(x)[0])
    state = gru.step(x[:, 0], None)
    torch.testing.assert_close(gru.step(x[:, 1], state), ref(x[:, :2])[0][:, 1])


@torch.no_grad()
def test_a_fresh_drafter_drafts_as_dflash_and_the_correction_starts_at_the_prefix_end(target):
    fresh = build_domino(DominoHeadsConfig(aux_layers=(1, 2, 3), block_size=4), target)
    assert not fresh.domino_head.embed_proj[2].weight.any()  # zero: no correction yet
    # its LM head is the target's own, frozen (and never saved)
    assert torch.equal(fresh.lm_head.weight, target.lm_head.weight) and not fresh.lm_head.weight.requires_grad
    normed, prev = torch.randn(2, 4, 64), torch.randint(3, 90, (2, 4))
    torch.testing.assert_close(fresh.teacher_forced_logits(normed, prev), fresh.lm_head(normed))
    head = _domino(target, pure_draft_prefix_len=2)
    logits = head.teacher_forced_logits(normed, prev)
    base = head.lm_head(normed)
    torch.testing.assert_close(logits[:, :2], base[:, :2])
    assert not torch.allclose(logits[:, 2:], base[:, 2:])


def test_lambda_falls_linearly_over_its_share_of_the_run(target):
    def lam(start: float, ratio: float, progress: float) -> float:
        return DominoHeadsConfig(lambda_base_start=start, lambda_base_decay_ratio=ratio).lambda_base(progress)

    assert [lam(1.0, 1.0, p) for p in (0, 0.25, 0.5, 1.0)] == [1.0, 0.75, 0.5, 0.0]
    assert [lam(1.0, 0.5, p) for p in (0, 0.25, 0.5, 0.8)] == [1.0, 0.5, 0.0, 0.0]
    assert lam(0.8, 1.0, 0.25) == pytest.approx(0.6)
    assert [lam(0.7, 0.0, p) for p in (0, 0.5, 1.0)] == [0.7] * 3  # ratio 0: held at its start
    assert build_domino(DominoHeadsConfig(aux_layers=(1, 2, 3)), target).run_progress == 0.0  # outside a run


def test_the_recipe_hands_lambda_the_share_of_the_run_and_the_drafter_keeps_none(tiny_run_inputs, tmp_path):
    """λ follows the recipe's steps (its minutes are `TrainingClock.run_progress`'s, tested with the clock); the saved
    drafter holds no trace of the schedule, and loads fresh."""
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out, "recipe=domino", "heads.aux_layers=[1,2,3]",
                                "draft_vocab_size=null", "max_steps=4", "save_every=4", "measure_prompts=0",
                                "heads.gru_hidden_dim=16", "heads.emb_dim=8")) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lambda_base"] for r in rows if "lambda_base" in r] == [1.0, 0.75, 0.5, 0.25]
    saved = load_file(out / "final" / "model.safetensors")
    assert not any("progress" in name or "trained" in name for name in saved)
    assert load_heads(out / "final", tiny_model("llama", seed=0)).run_progress == 0.0


def soft_ce(p: torch.Tensor, logits: torch.Tensor) -> float:
    return float(-(p * logits.log_softmax(-1)).sum())


@torch.no_grad()
def by_hand(head, target, tokens, settings, lam):
    """The step loss computed directly from the step's blocks: torch's GRU over the text's previous tokens, each
    entry's soft cross-entropy against the target, slot weights exp(-s / 4), AUF (when on) on the base argmax."""
    torch.manual_seed(0)
    step = block_step(head, target, text_batch(tokens, answer_from=2), settings.max_anchors, 0.0)
    gru = torch.nn.GRU(64, 16, batch_first=True, bias=False)
    gru.load_state_dict(head.domino_head.prefix_gru.state_dict())
    start = head.config.suffix_start
    base_terms, final_terms, m = [], [], 0
    for b in range(tokens.shape[0]):
        for i, a in enumerate(step.anchors[b].tolist()):
            failed = False
            for s in range(4):  # slot s drafts x_{a+s+1} after x_{a+s}
                if not step.valid[b, i, s]:
                    continue
                h = head.norm(step.outputs[b, i, s])
                base = head.lm_head(h)
                g = gru(head.embed_tokens(tokens[b, a : a + s + 1])[None])[0][0, -1]  # after x_a .. x_{a+s}
                final = base + head.domino_head.embed_proj(torch.cat([h, g])) if s >= start else base
                p = step.target_logits[m].softmax(-1)
                w = math.exp(-s / 4.0)
                if not (settings.accept_until_fail and failed):
                    base_terms.append((w, soft_ce(p, base)))
                failed = failed or int(base.argmax()) != int(p.argmax())
                final_terms.append((w, soft_ce(p, final)))
                m += 1
    assert m == int(step.valid.sum()) > 0

    def mean(terms):
        return sum(w * c for w, c in terms) / sum(w for w, _ in terms)

    return (1 - lam) * mean(final_terms) + lam * mean(base_terms), mean(final_terms), mean(base_terms), len(base_terms)


@pytest.mark.parametrize("auf", [False, True], ids=["full", "accept-until-fail"])
def test_the_loss_is_both_branches_weighted_by_lambda(target, auf):
    head = _domino(target).train()
    tokens = torch.randint(3, 90, (2, 16))
    settings = DominoHeadsConfig(block_size=4, max_anchors=3, accept_until_fail=auf)
    head.run_progress = 0.4  # as the recipe hands it: λ = 1 - 0.4
    torch.manual_seed(0)
    loss, stats = domino_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
    want, final, base, kept = by_hand(head, target, tokens, settings, lam=0.6)
    assert stats["lambda_base"] == pytest.approx(0.6)
    assert stats["loss_final"] == pytest.approx(final, rel=1e-5) and stats["loss_base"] == pytest.approx(base, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert {"top1", "top1_pos2", "top1_pos4", "top1_base", "loss_ce"} <= stats.keys()
    if auf:  # the base branch is cut at each block's first failure of its own argmax, the refined branch never
        assert stats["auf_kept"] < 1.0
        full = by_hand(head, target, tokens, DominoHeadsConfig(block_size=4, max_anchors=3), lam=0.6)
        assert final == pytest.approx(full[1]) and kept < full[3]
    else:
        assert "auf_kept" not in stats


def test_the_correction_trains_once_lambda_lets_it(target):
    tokens = torch.randint(3, 90, (2, 16))
    for lam, trained in ((1.0, False), (0.5, True)):
        head = _domino(target).train()
        settings = DominoHeadsConfig(block_size=4, lambda_base_start=lam)  # no run: progress 0, λ at its start
        loss, _ = domino_step_loss(head, target, text_batch(tokens, answer_from=2), settings)
        loss.backward()
        gru, proj = head.domino_head.prefix_gru.weight_hh_l0.grad, head.domino_head.embed_proj[2].weight.grad
        assert (gru is not None and bool(gru.any()) and bool(proj.any())) == trained, lam
        assert bool(head.fc.weight.grad.any()) and head.lm_head.weight.grad is None


def test_a_few_steps_lower_the_loss(target):
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(3, 60, (4, 1), generator=g)
    ids = (starts + 3 * torch.arange(24)) % 93 + 3  # counting up by 3: learnable
    batch = text_batch(ids, answer_from=4)
    settings = DominoHeadsConfig(aux_layers=(1, 2, 3), block_size=4, gru_hidden_dim=16, emb_dim=8,
                                 lambda_base_decay_ratio=0.5)
    torch.manual_seed(0)
    head = build_domino(settings, target).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses, lams = [], []
    for step in range(12):
        head.run_progress = step / 12  # what the recipe hands it over 12 steps
        loss, stats = domino_step_loss(head, target, batch, settings)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        lams.append(stats["lambda_base"])
    assert lams[0] == 1.0 and lams[6:] == [0.0] * 6  # λ reaches 0 halfway through
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses), losses
    assert bool(head.domino_head.embed_proj[2].weight.any())  # the correction has moved off zero


@torch.no_grad()
def test_eval_counts_the_refined_logits_after_the_texts_previous_tokens(target):
    head = _domino(target)
    tokens = torch.randint(3, 96, (2, 10))
    batch = text_batch(tokens)
    sums = domino_eval(head, target, batch)
    assert float(sums["starts"][0]) == 2 * 6  # anchors 0..5 leave room for x_{a+4} in 10 tokens
    assert sums["positions"].tolist() == [12.0] * 4
    feats = batch_features(target, batch, head.config.aux_layers)
    wanted = target.lm_head(last_layer(feats, 64)).argmax(-1)  # [2, 10]: the target's choice after each position
    hits, accepted = torch.zeros(4), 0
    for b in range(2):
        one = {k: v[b : b + 1] for k, v in batch.items()}
        for a in range(6):
            out = block_outputs(head, head, one, feats[b : b + 1], torch.tensor([[a]]))[0, 0]  # [4, H]
            logits = head.teacher_forced_logits(head.norm(out)[None], tokens[b, a : a + 4][None])[0]
            hit = logits.argmax(-1) == wanted[b, a : a + 4]
            hits += hit.float()
            accepted += int(hit.long().cumprod(0).sum())
    assert sums["correct_top1"].tolist() == hits.tolist() and float(sums["accepted"][0]) == accepted
    assert hits.sum() > 0  # the check has something to count


def test_bad_settings_are_refused_by_name(target):
    base = {"hidden_size": 64, "vocab_size": 96, "aux_layers": (1, 2, 3)}
    with pytest.raises(ValueError, match="domino's correction scores the target's whole vocabulary.*set "
                                         "draft_vocab_size: null in the recipe"):
        DominoConfig(**base, draft_vocab=tuple(range(3, 80)))
    with pytest.raises(ValueError, match=r"pure_draft_prefix_len must be in \[0, block_size\) = \[0, 4\)"):
        DominoConfig(**base, block_size=4, pure_draft_prefix_len=4)
    with pytest.raises(ValueError, match="domino gru_hidden_dim must be >= 1"):
        DominoHeadsConfig(gru_hidden_dim=0)
    with pytest.raises(ValueError, match=r"heads.lambda_base_decay_ratio must be in \[0, 1\]"):
        DominoHeadsConfig(lambda_base_decay_ratio=1.5)
    with pytest.raises(ValueError, match="recipe domino corrects logits over the target's whole vocabulary.* set "
                                         "draft_vocab_size: null"):
        load_train_config(None, ["recipe=domino"])
    assert isinstance(DominoHead(DominoConfig(**base, block_size=4), target), DominoHead)

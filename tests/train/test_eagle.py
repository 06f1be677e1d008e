"""The EAGLE objective: the training-time-test unroll drafts exactly as the inference drafter does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specheads.heads.eagle import EagleConfig
from specheads.train.chain_loss import chain_eval, ttt_mask, unroll
from specheads.train.eagle import EagleHeadsConfig, build_eagle, eagle_step_loss
from specheads.train.eagle3 import Eagle3HeadsConfig, build_eagle3, eagle3_step_loss
from tests.conftest import tiny_model


@pytest.fixture(params=["eagle1", "aux-layers", "eagle3"])
def head_and_inputs(request):
    target = tiny_model("llama", seed=0)
    torch.manual_seed(1)
    if request.param == "eagle3":  # two layers, so the later standard layers see the cache and masks too
        head = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3), num_layers=2), target).eval()
    else:
        head = build_eagle(_cfg(aux_layers=() if request.param == "eagle1" else (1, 2)), target).eval()
    with torch.no_grad():  # a head that is not the identity, so wrong attention shows in the outputs
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tokens = torch.randint(3, 96, (2, 12))
    feats = torch.randn(2, 12, head.feature_width)  # target features: wider with aux layers
    positions = torch.arange(12).expand(2, 12)
    return target, head, tokens, feats, positions


def test_ttt_mask_sees_the_prefix_and_the_chain_only():
    mask = ttt_mask(5, 2, torch.float32, torch.device("cpu"))[0, 0] == 0  # [5, 15] allowed
    # Query 4 drafts step 2 of the chain started at 2: real keys 0..2, step-1 key 3, its own key 4.
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert mask[2].nonzero().flatten().tolist() == [0, 5 + 1, 10 + 2]  # the chain started at the first token


@torch.no_grad()
def test_unroll_equals_sequential_drafting_with_a_cache(head_and_inputs):
    _, head, tokens, feats, positions = head_and_inputs
    outs = unroll(head, tokens, feats, positions, steps=3)
    for start in (0, 4, 8):
        cache = DynamicCache()
        step = head(tokens[:, : start + 1], feats[:, : start + 1], positions[:, : start + 1], cache=cache)[:, -1:]
        torch.testing.assert_close(outs[0][:, start], step[:, 0], rtol=1e-4, atol=1e-5)
        for k in (1, 2):
            i = start + k
            step = head(tokens[:, i : i + 1], step, positions[:, i : i + 1], cache=cache)
            torch.testing.assert_close(outs[k][:, i], step[:, 0], rtol=1e-4, atol=1e-5)


def test_ttt_loss_trains_every_step_and_its_first_step_is_eagle1(head_and_inputs):
    target, head, tokens, _, _ = head_and_inputs
    if not isinstance(head.config, EagleConfig):
        pytest.skip("EAGLE-1's feature loss; test_eagle3_loss covers EAGLE-3")
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    head.train()
    loss, stats = eagle_step_loss(head, target, batch, _cfg(ttt_steps=3))
    assert {"top1", "top1_step2", "top1_step3", "loss_ce_step3"} <= stats.keys()
    loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0
    aux = head.config.aux_layers
    _, plain = eagle_step_loss(head, target, batch, _cfg(ttt_steps=1, aux_layers=aux))
    assert plain["loss_reg"] == pytest.approx(stats["loss_reg"], rel=1e-5)
    assert plain["loss_ce"] == pytest.approx(stats["loss_ce"], rel=1e-5)
    # EAGLE-3's loss: no feature term, steps weighted ttt_decay**k.
    ce_only, st = eagle_step_loss(head, target, batch,
                                  _cfg(ttt_steps=2, reg_weight=0.0, cls_weight=1.0, aux_layers=aux))
    assert float(ce_only) == pytest.approx((st["loss_ce"] + 0.8 * st["loss_ce_step2"]) / 1.8, rel=1e-5)


def test_eval_counts_chains_from_the_target_choices(head_and_inputs):
    target, head, tokens, _, _ = head_and_inputs
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    sums = chain_eval(head, target, batch, steps=3)
    assert sums["positions"].tolist() == [22.0, 20.0, 18.0]  # 2 rows x (11 - k) chain starts
    assert (sums["correct_top1"] <= sums["correct_topk"]).all()
    assert 0 <= sums["accepted"].item() <= 3 * sums["starts"].item()
    short = {k: v[:, :3] for k, v in batch.items()}  # 2 chain starts: fewer than the steps evaluated
    narrow = chain_eval(head, target, short, steps=3)
    assert narrow["positions"].tolist() == [4.0, 2.0, 0.0]  # the same shape as every other batch's, so sums add up


def test_eagle3_loss_is_the_decayed_ce_of_every_step_and_trains_the_own_lm_head():
    target = tiny_model("llama", seed=0)
    torch.manual_seed(1)
    head = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3), ttt_steps=3, ttt_decay=0.5), target,
                        draft_vocab=list(range(3, 60)))
    tokens = torch.randint(3, 96, (2, 12))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    loss, st = eagle3_step_loss(head, target, batch, head_settings := Eagle3HeadsConfig(aux_layers=(1, 2, 3),
                                                                                         ttt_steps=3, ttt_decay=0.5))
    assert head_settings.ttt_steps == 3 and "loss_reg" not in st
    want = (st["loss_ce"] + 0.5 * st["loss_ce_step2"] + 0.25 * st["loss_ce_step3"]) / 1.75
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    for name in ("fc.weight", "lm_head.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name


def _cfg(**heads) -> EagleHeadsConfig:
    return EagleHeadsConfig(**heads)


def test_eagle3_with_a_frozen_lm_head_trains_all_else_and_saves_the_targets_rows(tiny_run_inputs, tmp_path):
    """`heads.train_lm_head=false`, as speculators' trainer runs EAGLE-3: no gradient reaches the LM head, both
    optimizers leave it where the target's rows put it (decay included), and everything else trains."""
    import json

    from safetensors.torch import load_file

    from specheads.target import load_target
    from specheads.train.__main__ import main as train_main
    from tests.conftest import base_args

    target = tiny_model("llama", seed=0)
    frozen = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3), train_lm_head=False), target,
                          draft_vocab=list(range(3, 60)))
    tokens = torch.randint(3, 96, (2, 12))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens)}
    eagle3_step_loss(frozen, target, batch, Eagle3HeadsConfig(aux_layers=(1, 2, 3)))[0].backward()
    assert frozen.lm_head.weight.grad is None and frozen.fc.weight.grad.abs().sum() > 0

    for optimizer in ("adamw", "muon"):
        out = tmp_path / optimizer
        assert train_main(base_args(tiny_run_inputs, out, "recipe=eagle3", "heads.aux_layers=[1,2,3]",
                                    "heads.train_lm_head=false", f"optim.optimizer={optimizer}", "optim.lr=0.01",
                                    "optim.weight_decay=0.1", "max_steps=3", "save_every=3", "measure_prompts=0")) == 0
        saved = load_file(out / "final" / "model.safetensors")
        draft_vocab = json.loads((out / "final" / "config.json").read_text())["config"]["draft_vocab"]
        fresh = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3)), load_target(str(tiny_run_inputs[0]))[0],
                             draft_vocab=draft_vocab)
        assert torch.equal(saved["lm_head.weight"], fresh.lm_head.weight.detach()), optimizer
        assert not torch.equal(saved["fc.weight"], fresh.fc.weight.detach()), optimizer


def test_eagle3_init_std_draws_every_matrix_but_the_lm_head_from_a_normal():
    target = tiny_model("llama", seed=0)
    torch.manual_seed(0)
    default = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3)), target)
    torch.manual_seed(0)
    normal = build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3), init_std=0.5), target)
    assert torch.equal(normal.lm_head.weight, default.lm_head.weight)  # both the target's rows
    matrices = [(n, p) for n, p in normal.named_parameters() if p.ndim == 2 and not n.startswith("lm_head")]
    assert {n for n, _ in matrices} >= {"fc.weight", "layers.0.self_attn.q_proj.weight",
                                        "layers.0.mlp.down_proj.weight"}
    for name, weight in matrices:  # torch's default draws from ±1/sqrt(fan_in), far below 0.5 here
        assert 0.4 < float(weight.std()) < 0.6 and float(default.get_parameter(name).std()) < 0.2, name
    with pytest.raises(ValueError, match="heads.init_std must be > 0"):
        Eagle3HeadsConfig(init_std=0.0)

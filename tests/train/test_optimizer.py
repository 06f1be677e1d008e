"""train/optimizer.py: which parameters Muon steps, and the Muon-with-AdamW pair acting as one optimizer (its steps,
its schedule, its saved state)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from specheads.train import optimizer as optimizer_module
from specheads.train.config import OptimConfig
from specheads.train.objective import OBJECTIVES, one_group
from specheads.train.optimizer import BETAS, Fp32Muon, MuonAdamW, build_optimizer, orthogonalised
from tests.conftest import TINY_VOCAB, tiny_model

DRAFT_VOCAB = list(range(0, TINY_VOCAB, 2))  # a draft vocabulary of its own size (48), unlike any hidden size


def _split(recipe: str, draft_vocab: list[int] | None = DRAFT_VOCAB, **settings) -> tuple[set[str], set[str]]:
    """(names Muon steps, names AdamW steps) of the recipe's drafter on a tiny 8-layer target."""
    objective = OBJECTIVES.get(recipe)
    target = tiny_model("llama", layers=8)
    module = objective.build(objective.settings(**settings), target, draft_vocab)
    groups = objective.param_groups(module, 1e-3, objective.settings(**settings))
    optimizer = build_optimizer(module, groups, OptimConfig(optimizer="muon"),
                                vocab_sizes=(TINY_VOCAB, len(draft_vocab or ())))
    names = {id(p): n for n, p in module.named_parameters()}
    muon, adamw = optimizer.inner
    return ({names[id(p)] for g in muon.param_groups for p in g["params"]},
            {names[id(p)] for g in adamw.param_groups for p in g["params"]})


def test_muon_steps_the_hidden_matrices_and_adamw_the_vocabulary_rows_and_the_vectors():
    muon, adamw = _split("eagle3")
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= muon
    assert "lm_head.weight" in adamw  # [draft vocab, H]: one row per token
    assert all(name.endswith("norm.weight") for name in adamw - {"lm_head.weight"})
    spark_muon, spark_adamw = _split("dspark", draft_vocab=None)
    # the Markov head's factors index the (whole) vocabulary; the confidence head's [1, N] projection is a vector
    markov = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert markov | {"confidence_head.proj.weight"} <= spark_adamw
    assert "fc.weight" in spark_muon


def test_lora_factors_stay_on_adamw():
    muon, adamw = _split("medusa2", draft_vocab=None)
    assert any("lora_A" in name for name in adamw) and not any("lora_" in name for name in muon)
    assert muon  # the heads' own matrices


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    return model(x).square().mean()


def test_one_step_is_torchs_muon_and_adamw_stepped_apart(monkeypatch):
    monkeypatch.setattr(optimizer_module, "cpu_has_native_bf16", lambda: True)  # torch's own Muon, as on such a CPU
    config = OptimConfig(optimizer="muon", lr=0.02, weight_decay=0.01, muon_weight_decay=0.1)
    together, apart = _model(), _model()
    optimizer = build_optimizer(together, one_group(together, config.lr, None), config, vocab_sizes=())
    matrices = [apart[0].weight, apart[2].weight]
    rest = [p for p in apart.parameters() if not any(p is m for m in matrices)]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.01, betas=BETAS)
    for seed in range(3):
        _loss(together, seed).backward()
        optimizer.step()
        optimizer.zero_grad()
        _loss(apart, seed).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    for a, b in zip(together.parameters(), apart.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fused AdamW against the loop: rounding only
    assert not torch.equal(together[0].weight, _model()[0].weight)


def _scheduled(model: torch.nn.Module) -> tuple[MuonAdamW, torch.optim.lr_scheduler.LambdaLR]:
    config = OptimConfig(optimizer="muon", lr=0.01)
    optimizer = build_optimizer(model, one_group(model, config.lr, None), config, vocab_sizes=())
    return optimizer, get_cosine_schedule_with_warmup(optimizer, 2, 10)


def _train(model, optimizer, scheduler, seeds) -> None:
    for seed in seeds:
        _loss(model, seed).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_the_schedule_sets_both_optimizers_rates_and_a_reload_resumes_both_states():
    model = _model()
    optimizer, scheduler = _scheduled(model)
    _train(model, optimizer, scheduler, range(3))
    expected = scheduler.get_last_lr()[0]
    assert expected not in (0.0, 0.01)
    assert [g["lr"] for inner in optimizer.inner for g in inner.param_groups] == [expected, expected]
    # copies, as a checkpoint on disk is: a state dict holds the live state tensors
    saved, saved_scheduler = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())
    saved_model = copy.deepcopy(model)
    _train(model, optimizer, scheduler, range(3, 6))

    resumed_model = saved_model
    resumed, resumed_scheduler = _scheduled(resumed_model)
    resumed.load_state_dict(saved)
    resumed_scheduler.load_state_dict(saved_scheduler)
    _train(resumed_model, resumed, resumed_scheduler, range(3, 6))  # the schedule still reaches the loaded groups
    assert [g["lr"] for inner in resumed.inner for g in inner.param_groups] == [scheduler.get_last_lr()[0]] * 2
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_state_of_another_optimizer_is_refused_by_name():
    model = _model()
    optimizer, _ = _scheduled(model)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optim.optimizer the checkpoint was trained with"):
        optimizer.load_state_dict(adamw.state_dict())


def test_an_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="optim.optimizer must be adamw or muon"):
        OptimConfig(optimizer="sgd")


def test_fp32_muon_takes_torchs_step_up_to_bf16_rounding_and_is_chosen_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(optimizer_module, "cpu_has_native_bf16", lambda: False)
    config = OptimConfig(optimizer="muon", lr=0.02, weight_decay=0.01, muon_weight_decay=0.1)
    model = _model()
    assert type(build_optimizer(model, one_group(model, config.lr, None), config, vocab_sizes=()).inner[0]) is Fp32Muon
    gen = torch.Generator().manual_seed(0)
    # full-rank gradients: on a rank-deficient one, bf16's rounding noise in the null space is what the iterations
    # amplify (slope 3.4 at zero, five times), so only fp32 keeps it near zero
    start = [torch.randn(shape, generator=gen) for shape in ((16, 40), (40, 16))]
    grads = [[torch.randn(w.shape, generator=gen) for w in start] for _ in range(3)]
    ours, torchs = [[torch.nn.Parameter(w.clone()) for w in start] for _ in range(2)]
    fp32 = Fp32Muon(ours, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    bf16 = torch.optim.Muon(torchs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step_grads in grads:
        for params in (ours, torchs):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
        fp32.step()
        bf16.step()
    for w, a, b in zip(start, ours, torchs):
        assert (b - w).abs().max() > 0.01  # it moved
        # bf16 carries 8 bits: torch's five iterations land 1-2% from fp32's (measured on 8x16 to 576x1728)
        assert (a - b).norm() <= 0.03 * (b - w).norm()
    state = fp32.state_dict()  # the same state as torch's Muon: either loads the other's
    bf16.load_state_dict(state)
    assert set(state["state"][0]) == {"momentum_buffer"}


def test_orthogonalised_brings_every_singular_value_near_one_for_tall_and_wide_matrices():
    gen = torch.Generator().manual_seed(0)
    for shape in ((12, 40), (40, 12)):
        update = torch.randn(shape, generator=gen) * torch.logspace(-3, 0, shape[1])  # badly conditioned
        out = orthogonalised(update, (3.4445, -4.7750, 2.0315), steps=5, eps=1e-7)
        assert out.shape == shape and out.dtype == torch.float32
        singular = torch.linalg.svdvals(out)
        assert singular.min() > 0.3 and singular.max() < 1.3  # Muon's iteration: about U Vᵀ, not exactly

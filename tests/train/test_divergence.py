"""Each divergence equals its textbook formula on hand-made distributions, and behaves as a loss should."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.train import divergence
from specheads.train.divergence import DIVERGENCES, soft_cross_entropy, token_divergence, token_divergences

P = [0.5, 0.3, 0.2]  # the target's distribution
Q = [0.2, 0.2, 0.6]  # the drafter's


def logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


@pytest.mark.parametrize(("name", "want"), [
    ("forward_kl", kl(P, Q)),
    ("reverse_kl", kl(Q, P)),
    ("jsd", 0.5 * kl(P, [(x + y) / 2 for x, y in zip(P, Q)]) + 0.5 * kl(Q, [(x + y) / 2 for x, y in zip(P, Q)])),
    ("tv", 0.5 * sum(abs(x - y) for x, y in zip(P, Q))),
])
def test_each_divergence_equals_its_formula(name, want):
    got = token_divergence(name, logits(P), logits(Q))
    assert got.shape == () and got.dtype == torch.float32
    assert float(got) == pytest.approx(want, rel=1e-5)
    assert float(token_divergence(name, logits(P), logits(P))) == pytest.approx(0.0, abs=1e-6)


def test_jsd_weights_and_temperature_follow_their_definitions():
    beta = 0.2
    m = [beta * x + (1 - beta) * y for x, y in zip(P, Q)]
    got = token_divergence("jsd", logits(P), logits(Q), beta=beta)
    assert float(got) == pytest.approx(beta * kl(P, m) + (1 - beta) * kl(Q, m), rel=1e-5)
    # At temperature 2 both sides are softmax(log p / 2) = normalised sqrt(p).
    def soften(d):
        return [math.sqrt(x) / sum(math.sqrt(y) for y in d) for x in d]
    got = token_divergence("forward_kl", logits(P), logits(Q), temperature=2.0)
    assert float(got) == pytest.approx(kl(soften(P), soften(Q)), rel=1e-5)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_gradients_reach_the_drafter_only_and_lower_the_divergence(name):
    target = torch.randn(4, 7, 50, requires_grad=True)  # [B, T, V]
    draft = torch.randn(4, 7, 50, requires_grad=True)
    loss = token_divergence(name, target, draft).mean()
    loss.backward()
    assert target.grad is None and torch.isfinite(draft.grad).all() and draft.grad.abs().sum() > 0
    with torch.no_grad():  # one small step against the gradient lowers the loss
        assert token_divergence(name, target, draft - 0.5 * draft.grad).mean() < loss


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize(("temperature", "beta"), [(1.0, 0.5), (2.0, 0.2)])
def test_the_fused_loss_has_the_formulas_values_and_gradients(name, temperature, beta, monkeypatch):
    monkeypatch.setattr(divergence, "_BLOCK_ELEMENTS", 3 * 64)  # 3 rows a block: 28 rows cross block edges
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(4, 7, 64, generator=generator) * 3
    if name != "reverse_kl":  # where the drafter says them, reverse KL is infinite (tested below)
        target[0, 0, :5] = float("-inf")  # tokens the target never says
    draft = (torch.randn(4, 7, 64, generator=generator) * 3).requires_grad_(True)
    weights = torch.rand(4, 7, generator=generator)  # a non-uniform upstream gradient
    (token_divergence(name, target, draft, temperature=temperature, beta=beta) * weights).sum().backward()
    fused_grad, draft.grad = draft.grad, None
    reference = token_divergences((name,), target, draft, temperature=temperature, beta=beta)[name]
    (reference * weights).sum().backward()
    fused = token_divergence(name, target, draft.detach(), temperature=temperature, beta=beta)
    assert fused.shape == (4, 7) and fused.dtype == torch.float32
    torch.testing.assert_close(fused, reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, draft.grad, rtol=1e-4, atol=1e-7)


def test_bf16_logits_are_scored_in_fp32_and_impossible_tokens_give_no_nan():
    target = torch.tensor([[0.0, 1.0, float("-inf")]])  # the target never says token 2
    draft = torch.tensor([[0.5, 0.5, 0.0]], requires_grad=True)
    for name in DIVERGENCES:
        loss = token_divergence(name, target.bfloat16(), draft.bfloat16())
        assert loss.dtype == torch.float32, name
        assert name == "reverse_kl" or torch.isfinite(loss).all(), name  # reverse KL: see below
        if name == "forward_kl":
            loss.sum().backward()
            assert torch.isfinite(draft.grad).all() and draft.grad.dtype == torch.float32
    # The drafter putting mass where the target has none: infinite reverse KL, as the formula says.
    assert float(token_divergence("reverse_kl", target, draft.detach())) == math.inf


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "kl"}, "unknown divergence 'kl'; use one of: forward_kl, reverse_kl, jsd, tv, nla, lk"),
    ({"name": "jsd", "beta": 1.0}, r"beta must be in \(0, 1\)"),
    ({"name": "tv", "temperature": 0.0}, "temperature must be > 0"),
])
def test_bad_settings_are_named(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message):
        token_divergence(name, logits(P), logits(Q), **kwargs)


def test_soft_cross_entropy_is_the_autograd_formula_in_value_and_gradient(monkeypatch):
    monkeypatch.setattr(divergence, "_BLOCK_ELEMENTS", 3 * 64)  # blocks of 3 rows
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(10, 64, generator=generator) * 3
    target[0, :5] = float("-inf")  # tokens the target never says add nothing
    draft = torch.randn(10, 64, generator=generator) * 3
    draft[2:6] = target[2:6] / 2  # these rows agree on the top token
    draft.requires_grad_(True)
    weights = torch.rand(10, generator=generator)
    ce, agree = soft_cross_entropy(target, draft)
    (ce * weights).sum().backward()
    fused_grad, draft.grad = draft.grad, None
    reference = -(target.softmax(-1) * draft.log_softmax(-1)).sum(-1)
    (reference * weights).sum().backward()
    torch.testing.assert_close(ce.detach(), reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, draft.grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(agree, target.argmax(-1) == draft.argmax(-1)) and agree[2:6].all() and not agree.all()
    # cross-entropy = forward KL + the target's entropy
    p = target.softmax(-1)
    entropy = -(p * p.log()).nan_to_num().sum(-1)
    torch.testing.assert_close(soft_cross_entropy(target, draft.detach())[0],
                               token_divergence("forward_kl", target, draft.detach()) + entropy, rtol=1e-5, atol=1e-5)


def test_the_acceptance_losses_on_distributions_made_by_hand():
    p, q = [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]  # overlap α = 0.5
    assert float(token_divergence("nla", logits(p), logits(q))) == pytest.approx(math.log(2), rel=1e-5)
    lam = math.exp(-3.0 * 0.5)  # λ = exp(−η α), η = 3; KL(p ‖ q) = log 2, TV = 0.5
    assert float(token_divergence("lk", logits(p), logits(q))) == pytest.approx(lam * math.log(2) + (1 - lam) * 0.5,
                                                                                rel=1e-5)
    # a one-hot target: −log α is the cross-entropy −log q(y)
    assert float(token_divergence("nla", logits([1.0, 0.0, 0.0]), logits(q))) == pytest.approx(math.log(4), rel=1e-5)
    # disjoint distributions: α under the floor gives a finite loss and no gradient
    draft = logits([0.0, 0.0, 1.0]).requires_grad_(True)
    loss = token_divergence("nla", logits([1.0, 0.0, 0.0]), draft)
    loss.backward()
    assert float(loss) == pytest.approx(-math.log(divergence.NLA_FLOOR)) and float(draft.grad.abs().sum()) == 0.0


PEER = {"forward_kl": "kl_div_loss", "reverse_kl": "reverse_kl_div_loss", "jsd": "js_div_loss", "tv": "tv_loss",
        "nla": "neg_log_acceptance_loss", "lk": "lk_hybrid_loss"}


@pytest.mark.interop
@pytest.mark.parametrize("name", DIVERGENCES)
def test_every_divergence_has_speculators_values_and_gradients(name):
    eager = pytest.importorskip("speculators.losses.eager", reason="scripts/setup.sh installs speculators")
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(1, 12, 80, generator=generator) * 2
    draft = (target + torch.randn(1, 12, 80, generator=generator) * 1.5).requires_grad_(True)  # overlaps 0.2-0.8
    weights = torch.rand(1, 12, generator=generator)
    theirs = getattr(eager, PEER[name])(draft, target)
    (theirs * weights).sum().backward()
    their_grad, draft.grad = draft.grad, None
    ours = token_divergence(name, target, draft)
    (ours * weights).sum().backward()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(draft.grad, their_grad, rtol=1e-4, atol=1e-7)

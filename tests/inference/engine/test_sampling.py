"""SamplingParams: validation, the logits -> probabilities transform, seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.inference.engine.sampling import SamplingParams, sample


def random_logits(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [-1e-6, -0.5, -3.0, math.nan])
def test_rejects_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.0000001, 1.5, math.nan])
def test_rejects_top_p_outside_unit_interval(top_p):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=top_p)


@pytest.mark.parametrize("top_k", [-1, -10])
def test_rejects_negative_top_k(top_k):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=top_k)


def test_accepts_boundary_values():
    SamplingParams(temperature=0.0)
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    SamplingParams(temperature=1.0, top_k=1, top_p=1e-6)


def test_greedy_flag_and_defaults():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    with pytest.raises(AssertionError):
        SamplingParams().probs(torch.zeros(4))  # greedy callers take the argmax instead


# --- temperature --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5, 4.0])
def test_temperature_scales_logits(temperature):
    logits = random_logits(3, 11, seed=1)
    got = SamplingParams(temperature=temperature).probs(logits)
    torch.testing.assert_close(got, torch.softmax(logits / temperature, dim=-1))
    torch.testing.assert_close(got.sum(-1), torch.ones(3))


def test_low_temperature_sharpens_high_temperature_flattens():
    logits = random_logits(20, seed=2)
    entropy = {}
    for t in [0.05, 0.5, 1.0, 2.0, 50.0]:
        p = SamplingParams(temperature=t).probs(logits)
        entropy[t] = float(-(p * p.clamp(min=1e-30).log()).sum())
    assert list(entropy.values()) == sorted(entropy.values())
    assert SamplingParams(temperature=0.05).probs(logits).argmax() == logits.argmax()
    assert float(SamplingParams(temperature=0.05).probs(logits).max()) > 0.99
    assert entropy[50.0] > math.log(20) - 0.05


def test_probs_is_fp32_and_keeps_batch_shape():
    logits = random_logits(2, 3, 9, seed=3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        p = SamplingParams(temperature=0.8, top_k=4, top_p=0.9).probs(logits.to(dtype))
        assert p.dtype == torch.float32
        assert p.shape == (2, 3, 9)
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 3))


# --- top-k --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 7, 15])
def test_top_k_keeps_exactly_k_tokens(k):
    vocab = 16
    logits = random_logits(32, vocab, seed=4)  # continuous values: no ties
    p = SamplingParams(temperature=1.0, top_k=k).probs(logits)
    assert ((p > 0).sum(-1) == k).all()
    top = torch.topk(logits, k, dim=-1).indices
    kept = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
    assert torch.equal(p > 0, kept)
    # The kept tokens keep their relative probabilities (renormalised softmax over the kept set).
    expected = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
    torch.testing.assert_close(p, expected)


@pytest.mark.parametrize("k", [0, 16, 100])
def test_top_k_zero_or_at_least_vocab_keeps_everything(k):
    logits = random_logits(4, 16, seed=5)
    p = SamplingParams(temperature=1.0, top_k=k).probs(logits)
    torch.testing.assert_close(p, torch.softmax(logits, dim=-1))


def test_top_k_with_temperature_keeps_the_same_set():
    logits = random_logits(8, 12, seed=6)
    a = SamplingParams(temperature=0.4, top_k=3).probs(logits)
    b = SamplingParams(temperature=2.5, top_k=3).probs(logits)
    assert torch.equal(a > 0, b > 0)


def test_top_k_ties_keep_every_tied_token():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    p = SamplingParams(temperature=1.0, top_k=2).probs(logits)
    # Strictly larger logits are always kept; tokens tied with the k-th are not split arbitrarily.
    assert p[0] > 0 and p[1] == 0 and p[4] == 0
    assert (p > 0).sum() >= 2


# --- top-p --------------------------------------------------------------------------------------


def nucleus_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest prefix of the tokens sorted by probability whose mass reaches top_p (1-D)."""
    order = sorted(range(probs.shape[0]), key=lambda i: -float(probs[i]))
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for i in order:
        keep[i] = True
        mass += float(probs[i])
        if mass >= top_p:
            break
    return keep


def test_top_p_hand_example_keeps_the_crossing_token():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log()
    cases = {0.4: [1, 0, 0, 0], 0.7: [1, 1, 0, 0], 0.85: [1, 1, 1, 0], 0.97: [1, 1, 1, 1], 1.0: [1, 1, 1, 1]}
    for top_p, keep in cases.items():
        p = SamplingParams(temperature=1.0, top_p=top_p).probs(logits)
        keep_t = torch.tensor(keep, dtype=torch.bool)
        assert torch.equal(p > 0, keep_t), (top_p, p)
        torch.testing.assert_close(p, torch.where(keep_t, base, 0.0) / base[keep_t].sum())


def test_top_p_order_does_not_matter():
    base = torch.tensor([0.05, 0.3, 0.15, 0.5])
    p = SamplingParams(temperature=1.0, top_p=0.7).probs(base.log())
    assert torch.equal(p > 0, torch.tensor([False, True, False, True]))


@pytest.mark.parametrize("seed", range(5))
def test_top_p_keeps_smallest_prefix_reaching_mass(seed):
    logits = random_logits(40, 10, seed=10 + seed, scale=1.5)
    full = torch.softmax(logits, dim=-1)
    g = torch.Generator().manual_seed(seed)
    checked = 0
    for top_p in torch.rand(12, generator=g).tolist() + [0.999]:
        top_p = max(top_p, 1e-3)
        p = SamplingParams(temperature=1.0, top_p=top_p).probs(logits)
        for row in range(logits.shape[0]):
            cumsum = full[row].sort(descending=True).values.cumsum(0)
            if (cumsum - top_p).abs().min() < 1e-4:
                continue  # too close to a boundary for float rounding to be irrelevant
            keep = nucleus_reference(full[row], top_p)
            assert torch.equal(p[row] > 0, keep), (top_p, full[row], p[row])
            assert float(full[row][keep].sum()) >= top_p
            # Minimal: dropping the smallest kept token falls below top_p.
            assert float(full[row][keep].sum() - full[row][keep].min()) < top_p
            torch.testing.assert_close(p[row], torch.where(keep, full[row], 0.0) / full[row][keep].sum())
            checked += 1
    assert checked > 400


def test_top_p_applies_after_temperature_and_top_k():
    logits = random_logits(30, 9, seed=20)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8)
    got = params.probs(logits)
    after_k = SamplingParams(temperature=0.7, top_k=4).probs(logits)
    checked = 0
    for row in range(logits.shape[0]):
        cumsum = after_k[row].sort(descending=True).values.cumsum(0)
        if (cumsum - 0.8).abs().min() < 1e-4:
            continue
        keep = nucleus_reference(after_k[row], 0.8)
        torch.testing.assert_close(got[row], torch.where(keep, after_k[row], 0.0) / after_k[row][keep].sum())
        checked += 1
    assert checked > 20


def test_tiny_top_p_is_greedy_like():
    logits = random_logits(16, 13, seed=21)
    p = SamplingParams(temperature=1.0, top_p=1e-6).probs(logits)
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(p.max(-1).values, torch.ones(16))


# --- sampling and seeds -------------------------------------------------------------------------


def test_generator_is_none_without_seed():
    assert SamplingParams(temperature=1.0).generator("cpu") is None


def test_seeded_generator_reproduces_samples():
    params = SamplingParams(temperature=0.9, top_k=5, seed=1234)
    probs = params.probs(random_logits(64, 10, seed=30))
    a = [sample(probs, params.generator("cpu")) for _ in range(3)]
    assert all(torch.equal(a[0], x) for x in a[1:])
    g1, g2 = params.generator("cpu"), params.generator("cpu")
    seq1 = [sample(probs, g1) for _ in range(5)]
    seq2 = [sample(probs, g2) for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(seq1, seq2, strict=True))
    other = SamplingParams(temperature=0.9, top_k=5, seed=4321).generator("cpu")
    assert not torch.equal(sample(probs, other), a[0])
    # Draws only ever land on tokens the processed distribution allows.
    assert (probs.gather(-1, a[0][:, None]) > 0).all()


def test_sample_shapes_and_one_hot():
    probs = torch.zeros(2, 3, 7)
    probs[..., 4] = 1.0
    out = sample(probs, torch.Generator().manual_seed(0))
    assert out.shape == (2, 3) and out.dtype == torch.long
    assert (out == 4).all()
    assert sample(torch.tensor([0.0, 0.0, 1.0])).shape == ()


def test_sample_frequencies_match_probs():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(7)
    draws = sample(probs.expand(40_000, 4), g)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)

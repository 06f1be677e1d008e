"""Token-level divergences between the frozen target's next-token distribution and a drafter's.

The distill recipe trains a draft model to match the target position by position. Which divergence
is best for speculative decoding depends on the task and the decoding settings (DistillSpec found no
single winner), so all four are offered and compared in one run:

- `forward_kl`:  KL(p ‖ q) = Σ p (log p − log q)   mass-covering: q spreads over every token p likes
- `reverse_kl`:  KL(q ‖ p) = Σ q (log q − log p)   mode-seeking: q concentrates on p's top tokens
- `jsd`:         β KL(p ‖ m) + (1 − β) KL(q ‖ m), m = β p + (1 − β) q   bounded by the entropy of (β, 1 − β); β = 0.5
                 is the symmetric Jensen-Shannon divergence
- `tv`:          ½ Σ |p − q|   total variation: 1 − TV is exactly the chance that one drafted token is
                 accepted by speculative sampling, so minimising it maximises acceptance

p is the target's distribution and q the drafter's, both at `temperature` (logits / T); the loss is
not rescaled by T². Everything is computed in fp32 whatever the logits' dtype; the target's side is
detached (it is frozen).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tv")


def check_divergence(name: str, beta: float = 0.5, temperature: float = 1.0) -> None:
    """One clear error for a bad divergence setting (the config's validation calls this)."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; use one of: {', '.join(DIVERGENCES)}")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"the jsd weight beta must be in (0, 1) (0.5: symmetric), got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")


def token_divergence(
    name: str,
    target_logits: torch.Tensor,  # [..., V] the frozen target's logits (detached here)
    draft_logits: torch.Tensor,  # [..., V] the drafter's logits at the same positions
    *,
    temperature: float = 1.0,
    beta: float = 0.5,  # jsd only: the weight of the target's side
) -> torch.Tensor:  # [...] the divergence at every position, fp32
    return token_divergences((name,), target_logits, draft_logits, temperature=temperature, beta=beta)[name]


def token_divergences(
    names: tuple[str, ...],
    target_logits: torch.Tensor,  # [..., V]
    draft_logits: torch.Tensor,  # [..., V]
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> dict[str, torch.Tensor]:  # {name: [...]}: several divergences from one pair of log-softmaxes
    for name in names:
        check_divergence(name, beta, temperature)
    log_p = F.log_softmax(target_logits.detach().float() / temperature, dim=-1)
    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    return {name: _divergence(name, log_p, log_q, beta) for name in names}


def _divergence(name: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    if name == "forward_kl":
        return _kl(log_p, log_q)
    if name == "reverse_kl":
        return _kl(log_q, log_p)
    if name == "jsd":
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) over the last axis; tokens with a = 0 contribute nothing (even where b = 0)."""
    a = log_a.exp()
    # masked_fill, not torch.where: the unselected 0 * -inf would still send NaN into the gradients
    return (a * (log_a - log_b).masked_fill(a == 0, 0.0)).sum(-1)

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
- `nla`:         −log α, α = Σ min(p, q) = 1 − TV   negative log acceptance: TV's optimum, with its gradient scaled by
                 1/α, which keeps it useful while the overlap is small (a cold start); cross-entropy for a one-hot p
- `lk`:          λ KL(p ‖ q) + (1 − λ) TV, λ = exp(−η sg[α])   the LK hybrid (Samarin et al. 2026, arXiv 2602.23881):
                 forward KL's strong pull while the overlap is small, acceptance itself once it is large; η = 3

p is the target's distribution and q the drafter's, both at `temperature` (logits / T); the loss is
not rescaled by T². Everything is computed in fp32 whatever the logits' dtype; the target's side is
detached (it is frozen).

`token_divergence` (the training loss) computes each divergence and its gradient with respect to the drafter's
logits together, a block of rows at a time, and keeps only that gradient for the backward pass. Over a 49k
vocabulary these are memory-bound elementwise passes: autograd through the formulas below makes about twenty
full-size passes and temporaries per divergence, which cost more than the drafter's own forward and backward on
a CPU; in blocks that stay in cache, with the gradient in closed form, the loss costs a fraction of that. The
closed forms (z: the drafter's logits, q = softmax(z / T), g: the derivative with respect to q):
    forward KL  dL/dz = (q − p) / T
    otherwise   dL/dz = q (g − Σ q g) / T, with g = log q − log p (reverse KL), (1 − β)(log q − log m) (JSD),
                ½ sign(q − p) (TV), −[q < p] / α (NLA; zero once α is under its floor 1e-5)
    LK          dL/dz = λ (q − p) / T + (1 − λ) × TV's
`token_divergences` (evaluation: several at once, no gradient) evaluates the formulas directly; the tests hold
the two to the same values and gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tv", "nla", "lk")
NLA_FLOOR = 1e-5  # α below this counts as this (a drafter disjoint from the target: no gradient, a finite loss)
LK_ETA = 3.0  # the LK hybrid's blend temperature (the paper's best setting)


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
    check_divergence(name, beta, temperature)
    return _FusedDivergence.apply(target_logits.detach(), draft_logits, name, temperature, beta, False)[0]


def soft_cross_entropy(
    target_logits: torch.Tensor,  # [..., V] the frozen target's logits (detached here)
    draft_logits: torch.Tensor,  # [..., V] the drafter's logits at the same positions
) -> tuple[torch.Tensor, torch.Tensor]:  # [...] -Σ p log q, fp32; [...] bool: the two argmaxes agree (top-1)
    """The heads recipes' loss: cross-entropy against the target's whole distribution (forward KL plus the
    target's entropy, so the same gradient q − p), fused like `token_divergence` rather than through autograd's
    softmax, log-softmax and product over the vocabulary. Top-1 agreement comes from the same blocks: an argmax
    over bf16 logits of the whole batch costs more than the loss itself on a CPU."""
    return _FusedDivergence.apply(target_logits.detach(), draft_logits, "cross_entropy", 1.0, 0.5, True)


HEAD_LOSSES = ("cross_entropy", *DIVERGENCES)


def head_loss(
    name: str,  # one of HEAD_LOSSES
    target_logits: torch.Tensor,  # [..., V] the frozen target's logits (detached here)
    draft_logits: torch.Tensor,  # [..., V] the drafter's logits at the same positions
) -> tuple[torch.Tensor, torch.Tensor]:  # [...] the loss, fp32; [...] bool: the two argmaxes agree (top-1)
    """A heads recipe's loss (`heads.loss`): `soft_cross_entropy` or one of the divergences, fused the same way."""
    if name not in HEAD_LOSSES:
        raise ValueError(f"unknown heads loss {name!r}; use one of: {', '.join(HEAD_LOSSES)}")
    return _FusedDivergence.apply(target_logits.detach(), draft_logits, name, 1.0, 0.5, True)


_BLOCK_ELEMENTS = 1 << 19  # rows per block x V: 2 MiB of fp32, so a block's passes stay in cache


class _FusedDivergence(torch.autograd.Function):
    """The divergence per row, with dL/d(draft logits) computed alongside and saved for the backward pass, and
    (when asked) whether the two argmaxes agree."""

    @staticmethod
    def forward(ctx, target_logits: torch.Tensor, draft_logits: torch.Tensor, name: str, temperature: float,
                beta: float, agreement: bool) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = draft_logits.shape[-1]
        target_rows, draft_rows = target_logits.reshape(-1, vocab), draft_logits.reshape(-1, vocab)
        values = torch.empty(draft_rows.shape[0], dtype=torch.float32, device=draft_rows.device)
        agree = torch.zeros(draft_rows.shape[0] if agreement else 0, dtype=torch.bool, device=draft_rows.device)
        want_grad = ctx.needs_input_grad[1]
        grad = torch.empty(draft_rows.shape, dtype=torch.float32, device=draft_rows.device) if want_grad else None
        block = max(1, _BLOCK_ELEMENTS // vocab)
        for start in range(0, draft_rows.shape[0], block):
            rows = slice(start, start + block)
            log_p = F.log_softmax(_scaled(target_rows[rows], temperature), dim=-1)
            log_q = F.log_softmax(_scaled(draft_rows[rows], temperature), dim=-1)
            values[rows] = _value_and_grad(name, log_p, log_q, beta, None if grad is None else grad[rows])
            if agreement:  # one argmax, not two: a CPU's argmax is ~20x slower than its max
                top_p = log_p.argmax(-1, keepdim=True)
                agree[rows] = (log_q.gather(-1, top_p) == log_q.amax(-1, keepdim=True)).squeeze(-1)
        if grad is not None:
            grad.div_(temperature)
        ctx.save_for_backward(grad)
        ctx.draft_shape, ctx.draft_dtype = draft_logits.shape, draft_logits.dtype
        ctx.mark_non_differentiable(agree)
        shape = draft_logits.shape[:-1]
        return values.reshape(shape), agree.reshape(shape if agreement else (0,))

    @staticmethod
    def backward(ctx, grad_values: torch.Tensor, _grad_agree: torch.Tensor | None = None):
        (grad,) = ctx.saved_tensors
        draft_grad = (grad * grad_values.reshape(-1, 1).float()).reshape(ctx.draft_shape).to(ctx.draft_dtype)
        return None, draft_grad, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T (no division pass at T = 1)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _value_and_grad(name: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float,
                    grad_out: torch.Tensor | None) -> torch.Tensor:
    """The divergence of each row of a block; writes dL/dz (before the 1/T) into `grad_out` when given."""
    q = log_q.exp()
    if name == "cross_entropy":
        p = log_p.exp()
        if grad_out is not None:
            torch.sub(q, p, out=grad_out)
        return -(p * log_q).sum(-1)
    if name == "forward_kl":
        p = log_p.exp()
        if grad_out is not None:
            torch.sub(q, p, out=grad_out)
        return _kl(log_p, log_q, p)
    if name == "reverse_kl":
        g = (log_q - log_p).masked_fill_(q == 0, 0.0)  # tokens the drafter never says carry no weight
        value = (q * g).sum(-1)
    elif name == "jsd":
        p = log_p.exp()
        # log m from the probabilities (one log, not logaddexp's four passes); the floor keeps m > 0 where both
        # underflow, tokens that carry no weight on either side
        log_m = (p * beta).add_(q, alpha=1.0 - beta).clamp_min_(torch.finfo(torch.float32).tiny).log_()
        g = (log_q - log_m).masked_fill_(q == 0, 0.0)
        value = beta * _kl(log_p, log_m, p) + (1.0 - beta) * (q * g).sum(-1)
        g.mul_(1.0 - beta)
    elif name == "tv":
        p = log_p.exp()
        g = (q - p).sign_().mul_(0.5)
        value = 0.5 * (q - p).abs_().sum(-1)
    else:  # nla and lk: through the overlap α = Σ min(p, q)
        p = log_p.exp()
        alpha = torch.minimum(p, q).sum(-1, keepdim=True)  # [n, 1]
        # d min(p, q) / dq: 1 where q < p, ½ at a tie (as autograd splits a minimum's gradient)
        below = (q < p).to(q.dtype).add_((q == p).to(q.dtype), alpha=0.5)
        if name == "nla":
            floored = alpha.clamp_min(NLA_FLOOR)
            g = below.neg_().div_(floored).mul_((alpha >= NLA_FLOOR).to(q.dtype))
            value = -floored.log().squeeze(-1)
        else:
            lam = torch.exp(-LK_ETA * alpha)  # [n, 1], held constant (stop-gradient)
            value = (lam.squeeze(-1) * _kl(log_p, log_q, p) + (1.0 - lam.squeeze(-1)) * (1.0 - alpha.squeeze(-1)))
            if grad_out is not None:  # λ (q − p) + (1 − λ) q (g − Σ q g), g = −[q < p]
                g = below.neg_()
                tv = q * g.sub_((q * g).sum(-1, keepdim=True))
                torch.add(tv.mul_(1.0 - lam), (q - p).mul_(lam), out=grad_out)
            return value
    if grad_out is not None:  # the softmax's Jacobian: q (g - Σ q g)
        torch.mul(q, g.sub_((q * g).sum(-1, keepdim=True)), out=grad_out)
    return value


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
    if name == "tv":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    alpha = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)
    if name == "nla":
        return -alpha.clamp_min(NLA_FLOOR).log()
    lam = torch.exp(-LK_ETA * alpha.detach())  # the blend follows α but is not differentiated through it
    return lam * _kl(log_p, log_q) + (1.0 - lam) * (1.0 - alpha)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
    """KL(a ‖ b) over the last axis (`a`: exp(log_a) when already computed); tokens with a = 0 contribute nothing
    (even where b = 0)."""
    a = log_a.exp() if a is None else a
    # masked_fill, not torch.where: the unselected 0 * -inf would still send NaN into the gradients
    return (a * (log_a - log_b).masked_fill(a == 0, 0.0)).sum(-1)

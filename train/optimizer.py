"""The optimizer of a training run: AdamW, or Muon on the drafter's hidden matrices with AdamW on the rest.

`optim.optimizer: muon` (speculators' trainer's default) steps Muon (`torch.optim.Muon`: momentum, then the update
orthogonalised by Newton-Schulz iterations, its scale matched to AdamW's so one learning rate serves both) on every
trainable 2-D matrix that maps hidden states, and AdamW on everything else:
- vectors and other shapes (norms, biases, a degenerate [1, N] projection, 3-D mixing weights): Muon orthogonalises
  matrices only;
- vocabulary-indexed matrices (an LM head, token embeddings, a Markov head's or a selector's codebooks): each row is
  one token's own vector, and orthogonalising the update would couple unrelated tokens;
- LoRA factors: the adapter's map is the product B·A, and orthogonalising each factor's update does not orthogonalise
  the product's.

torch's Muon runs its Newton-Schulz iterations in bf16, which a CPU without native bf16 (AVX512-BF16 or AMX)
emulates: there one step of a 576x1728 matrix took 7.4 s against 70 ms for an fp32 product of that size. On such a
CPU `Fp32Muon` runs the same step with the iterations in fp32 (same state, same update up to bf16's rounding).

Both inner optimizers run as one `torch.optim.Optimizer` whose `param_groups` are theirs, so one learning-rate
schedule drives both, accelerate prepares and checkpoints one object, and a resumed run restores both states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from specheads.machine import cpu_has_native_bf16
from specheads.train.config import OptimConfig

BETAS = (0.9, 0.95)


def build_optimizer(module: nn.Module, groups: list[dict[str, Any]], optim: OptimConfig,
                    vocab_sizes: Iterable[int]) -> torch.optim.Optimizer:
    """The run's optimizer over `groups` (an objective's parameter groups of `module`), as `optim` names it.

    `vocab_sizes`: the target's vocabulary and the drafter's draft vocabulary; a matrix with either as a dimension
    indexes tokens and stays on AdamW under Muon."""
    if optim.optimizer == "adamw":
        # fused: one kernel per step instead of a dozen passes over every parameter (5-8x faster for a distilled
        # drafter's 85M parameters on a CPU)
        return torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay, betas=BETAS, fused=True)
    names = {id(p): name for name, p in module.named_parameters()}
    vocab = set(vocab_sizes)
    muon_groups, adamw_groups = [], []
    for group in groups:
        params = list(group["params"])
        steps_muon = [_hidden_matrix(names.get(id(p), ""), p, vocab) for p in params]
        hidden = [p for p, muon in zip(params, steps_muon) if muon]
        rest = [p for p, muon in zip(params, steps_muon) if not muon]
        muon_groups += [{**group, "params": hidden}] if hidden else []
        adamw_groups += [{**group, "params": rest}] if rest else []
    return MuonAdamW(muon_groups, adamw_groups, lr=optim.lr, weight_decay=optim.weight_decay,
                     muon_weight_decay=optim.muon_weight_decay)


def _hidden_matrix(name: str, param: torch.Tensor, vocab: set[int]) -> bool:
    """Whether Muon steps `param` (the module doc says which matrices do not)."""
    return (param.ndim == 2 and min(param.shape) > 1 and not vocab & set(param.shape)
            and "lora_" not in name)


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `muon_groups` and AdamW over `adamw_groups`, stepped, scheduled and saved as one optimizer."""

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], *, lr: float,
                 weight_decay: float, muon_weight_decay: float) -> None:
        super().__init__([dict(g) for g in [*muon_groups, *adamw_groups]], {"lr": lr})
        self.inner: list[torch.optim.Optimizer] = []
        if muon_groups:
            muon = torch.optim.Muon if _native_bf16(muon_groups) else Fp32Muon
            self.inner.append(muon(muon_groups, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw"))
        if adamw_groups:
            self.inner.append(torch.optim.AdamW(adamw_groups, lr=lr, weight_decay=weight_decay, betas=BETAS,
                                                fused=True))
        # The inner optimizers' own group dicts: a scheduler that sets a group's rate sets it where it is read.
        self.param_groups = [group for optimizer in self.inner for group in optimizer.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = _loss_of(closure)
        for optimizer in self.inner:
            optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [optimizer.state_dict() for optimizer in self.inner]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("inner")
        if saved is None or len(saved) != len(self.inner):
            raise ValueError("the checkpoint's optimizer state is not this run's Muon and AdamW pair; resume with the "
                             "optim.optimizer the checkpoint was trained with")
        for optimizer, state in zip(self.inner, saved):
            optimizer.load_state_dict(state)
        self.param_groups = [group for optimizer in self.inner for group in optimizer.param_groups]  # loading made new


def _loss_of(closure: Any) -> Any:
    """What an optimizer's `step(closure)` returns: the closure's loss, evaluated with gradients on (None without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _native_bf16(groups: list[dict[str, Any]]) -> bool:
    """Whether the groups' parameters sit where bf16 products are native (a GPU, or a CPU with AVX512-BF16 or AMX)."""
    devices = {p.device.type for group in groups for p in group["params"]}
    return devices != {"cpu"} or cpu_has_native_bf16()


class Fp32Muon(torch.optim.Muon):
    """torch's Muon with the Newton-Schulz iterations in fp32 (see the module doc): the same arguments, state and
    update rule (momentum, Nesterov, orthogonalisation, the learning-rate adjustment, decoupled weight decay)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = _loss_of(closure)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            momentum = group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-group["lr"] * lr_ratio(group["adjust_lr_fn"], param.shape))
        return loss


def orthogonalised(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iterations on a 2-D update, in fp32: about U Vᵀ of its SVD U S Vᵀ (the singular
    values pushed into roughly [0.5, 1.5], which is all Muon needs)."""
    a, b, c = coefficients
    x = update.float()
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The factor torch's Muon scales a matrix's learning rate by: "match_rms_adamw" matches AdamW's update size
    (0.2 sqrt(max(A, B))); "original" (or None) sqrt(max(1, A / B))."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 1.0

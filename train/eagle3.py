"""The EAGLE-3 objective: the chain loss (`specheads.train.chain_loss`), the head's own LM head, no feature term.

EAGLE-3 drafts tokens, not features: its loss is the soft cross-entropy of each unrolled draft step
(training-time test) against the target's distribution over the draft vocabulary, step k weighted
ttt_decay**k. Evaluation is the same per-step agreement and simulated chain τ as EAGLE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.eagle3 import KIND_NAME, Eagle3Config, Eagle3Head
from specheads.heads.fused_chain import ChainLayout
from specheads.heads.fused_head import declared_by
from specheads.train.chain_loss import chain_eval, chain_eval_row, chain_loss
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective


@dataclass(frozen=True)
class Eagle3HeadsConfig(FusedHeadsConfig, ChainLayout):
    """The `heads:` section of an eagle3 recipe: the head's shape (its layout flags: `ChainLayout`) and the
    objective's settings."""

    ttt_steps: int = 3  # draft steps unrolled in training, each fed the previous step's outputs
    ttt_decay: float = 0.8  # loss weight of unrolled step k is ttt_decay**k
    train_lm_head: bool = True  # False: the draft LM head stays at the target's rows, as speculators' trainer keeps it
    init_std: float | None = None  # None: torch's fan-in uniform; s: matrices from normal(0, s), as HF models start

    def _check(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"heads.ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"heads.ttt_decay must be in (0, 1], got {self.ttt_decay}")
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(f"heads.init_std must be > 0 (e.g. 0.02) or null for torch's default, got {self.init_std}")


def build_eagle3(settings: Eagle3HeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config(**settings.head_fields(target, draft_vocab), **declared_by(ChainLayout, settings)),
                      target)
    head.lm_head.weight.requires_grad_(settings.train_lm_head)  # frozen, it leaves the optimizer (`one_group`)
    if settings.init_std is not None:  # every matrix but the LM head, which starts at the target's rows
        with torch.no_grad():
            for module in head.modules():
                if isinstance(module, torch.nn.Linear) and module is not head.lm_head:
                    module.weight.normal_(0.0, settings.init_std)
                    if module.bias is not None:
                        module.bias.zero_()
    return head


def eagle3_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: Eagle3HeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    return chain_loss(head, target, batch, ttt_steps=settings.ttt_steps, ttt_decay=settings.ttt_decay,
                      feature_noise=settings.feature_noise, loss=settings.loss)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=Eagle3HeadsConfig, build=build_eagle3, step_loss=eagle3_step_loss,
    eval_sums=chain_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

"""The DFlash objective (`specheads.train.block_objective`): slot j (1 <= j < B) of a block anchored at a learns the
target's distribution at position a+j-1 (the token x_{a+j}) by soft cross-entropy over the draft vocabulary,
weighted exp(-(j-1) / position_decay) by default (DFlash's decaying per-position weights: early slots decide whether
later ones count at all). Evaluation runs every anchor: per-slot top-1/top-k and the chain τ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.dflash import KIND_NAME, DFlashBlock, DFlashConfig, DFlashHead
from specheads.heads.fused_head import declared_by
from specheads.train.block_objective import (  # noqa: F401  (anchor_candidates, block_inputs, sample_anchors: here too)
    BlockTraining,
    anchor_candidates,
    block_eval,
    block_inputs,
    block_loss,
    block_outputs,
    block_step,
    drafted_outputs,
    sample_anchors,
)
from specheads.train.chain_loss import chain_eval_row
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective


@dataclass(frozen=True)
class DFlashHeadsConfig(FusedHeadsConfig, DFlashBlock, BlockTraining):
    """The `heads:` section of a dflash recipe: the drafter's shape (its block `DFlashBlock`: block_size,
    mask_token_id) and the objective's settings (`BlockTraining`)."""


def build_dflash(settings: DFlashHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> DFlashHead:
    config = DFlashConfig(**settings.head_fields(target, draft_vocab), **declared_by(DFlashBlock, settings))
    return DFlashHead(config, target)  # a mask token of None is chosen for the target here


def _blocks(head: torch.nn.Module, model: DFlashHead, batch: dict[str, torch.Tensor], features: torch.Tensor,
            anchors: torch.Tensor) -> torch.Tensor:  # [B, n, B-1, H]: the drafted slots' outputs
    return block_outputs(head, model, batch, features, anchors)[:, :, 1:]


def dflash_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: DFlashHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    step = block_step(head, target, batch, settings.max_anchors, settings.feature_noise)
    return block_loss(step, step.model.draft_logits(drafted_outputs(step)), settings.loss, settings)


def dflash_eval(head: torch.nn.Module, target: torch.nn.Module,
                batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return block_eval(head, target, batch, lambda model, out, text: model.draft_logits(out[:, 1:]))


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=DFlashHeadsConfig, build=build_dflash, step_loss=dflash_step_loss,
    eval_sums=dflash_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

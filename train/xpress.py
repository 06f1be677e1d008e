"""The XPress objective (`specheads.train.block_objective`, the DFlash objective's blocks; speculators' xpress
metrics): the d-th drafted slot of a block anchored at a learns the target's distribution at position a+d by
`heads.loss` over the draft vocabulary with the slot weights of `heads.position_weighting`, three times over:

    loss = L(teacher forced)  +  consistency_weight · mean_j L(pass j)  +  base_anchor_weight · L(without the bias)

- teacher forced: the refiner reads the text's own previous tokens (`XPressHead.previous_tokens`, the token before
  the anchor included);
- pass j (j = 1 .. `consistency_passes`): the refiner reads the argmax of pass j-1 (pass 0: the block's logits
  without the bias), exactly as a decoding step's Jacobi passes do, no gradient through the argmax; the passes'
  losses are averaged, so `consistency_weight` means the same whatever their number (0 passes or weight 0: none);
- without the bias: the drafter's own logits, which seed the passes, kept near the target as the refiner is trained
  on top of them (`base_anchor_full_weight`: this term's slots weighted alike, whatever `position_weighting`).

The teacher-forced logits give the per-slot top-1; evaluation drafts as decoding does (the Jacobi passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.fused_head import declared_by
from specheads.heads.xpress import KIND_NAME, XPressBlock, XPressConfig, XPressHead
from specheads.train.block_objective import (
    BlockStep,
    BlockTraining,
    block_eval,
    block_loss,
    block_step,
    block_tokens,
    tokens_before,
)
from specheads.train.chain_loss import chain_eval_row
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective
from specheads.train.position_weights import PositionWeighting

UNIFORM = PositionWeighting(position_weighting="uniform")


@dataclass(frozen=True)
class XPressHeadsConfig(FusedHeadsConfig, XPressBlock, BlockTraining):
    """The `heads:` section of an xpress recipe: the drafter's shape (`XPressBlock`: block_size, mask_token_id,
    sample_from_anchor, the refiner, the decoding passes) and the objective's settings (`BlockTraining` and the
    terms' weights, speculators' defaults)."""

    consistency_weight: float = 0.3  # weight of the Jacobi passes' mean loss (0: none)
    consistency_passes: int = 3  # Jacobi passes trained, each reading the argmax of the one before
    base_anchor_weight: float = 0.6  # weight of the loss of the logits without the bias (0: none)
    base_anchor_full_weight: bool = False  # that loss weighs every slot alike

    def _check(self) -> None:
        for key in ("consistency_weight", "base_anchor_weight"):
            if getattr(self, key) < 0:
                raise ValueError(f"heads.{key} must be >= 0 (0: no such term), got {getattr(self, key)}")
        if self.consistency_passes < 0:
            raise ValueError(f"heads.consistency_passes must be >= 0 (0: no consistency term), "
                             f"got {self.consistency_passes}")


def build_xpress(settings: XPressHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> XPressHead:
    config = XPressConfig(**settings.head_fields(target, draft_vocab), **declared_by(XPressBlock, settings))
    return XPressHead(config, target)  # a mask token of None is chosen for the target here


@dataclass
class XPressBlocks:
    """Every trained block's logits: teacher forced, after each Jacobi pass, and without the bias."""

    teacher_forced: torch.Tensor  # [B, n, block, Vd]
    passes: list[torch.Tensor]  # per pass [B, n, block, Vd]
    base: torch.Tensor  # [B, n, block, Vd]


def xpress_blocks(step: BlockStep, input_ids: torch.Tensor, passes: int) -> XPressBlocks:
    """The logits of the step's blocks (every slot's, the anchor's included), the passes' previous tokens read from
    the argmax of the pass before."""
    model: XPressHead = step.model
    block = model.config.block_size
    text = block_tokens(input_ids, step.anchors, block).flatten(0, 1)  # [N, block]
    before = tokens_before(input_ids, step.anchors).flatten()  # [N]
    normed = model.norm(step.outputs).flatten(0, 1)  # [N, block, H]
    base = model.lm_head(normed)
    cache = model.refiner_head.hidden_cache(normed)
    teacher = model.refined(base, cache, model.previous_tokens(text, before))
    rounds, last = [], base
    for _ in range(passes):
        tokens = model.jacobi_tokens(last.detach(), text[:, 0])
        last = model.refined(base, cache, model.previous_tokens(tokens, before))
        rounds.append(last)
    shape = step.outputs.shape[:3]
    return XPressBlocks(teacher.unflatten(0, shape[:2]), [r.unflatten(0, shape[:2]) for r in rounds],
                        base.unflatten(0, shape[:2]))


def entries(step: BlockStep, logits: torch.Tensor) -> torch.Tensor:  # [B, n, block, Vd] -> [M, Vd]
    return logits[:, :, step.model.config.first_slot:][step.valid]


def xpress_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: XPressHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    step = block_step(head, target, batch, settings.max_anchors, settings.feature_noise)
    passes = settings.consistency_passes if settings.consistency_weight > 0 else 0
    blocks = xpress_blocks(step, batch["input_ids"], passes)
    loss, stats = block_loss(step, entries(step, blocks.teacher_forced), settings.loss, settings)
    stats["loss_teacher_forced"] = float(loss.detach())
    if blocks.passes:
        consistency = torch.stack([block_loss(step, entries(step, r), settings.loss, settings)[0]
                                   for r in blocks.passes]).mean()
        loss = loss + settings.consistency_weight * consistency
        stats["loss_consistency"] = float(consistency.detach())
    if settings.base_anchor_weight > 0:
        weighting = UNIFORM if settings.base_anchor_full_weight else settings
        anchor, anchor_stats = block_loss(step, entries(step, blocks.base), settings.loss, weighting)
        loss = loss + settings.base_anchor_weight * anchor
        stats["loss_base_anchor"] = float(anchor.detach())
        stats["top1_base"] = anchor_stats["top1"]
    return loss, stats


def xpress_eval(head: torch.nn.Module, target: torch.nn.Module,
                batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`block_eval` of the drafts decoding makes: the block resolved by the drafter's Jacobi passes."""
    def slot_logits(model: XPressHead, out: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        normed = model.norm(out)
        logits = model.resolve(normed, model.lm_head(normed), text[:, 1], text[:, 0])
        return logits[:, model.config.first_slot:]

    return block_eval(head, target, batch, slot_logits, before=True)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=XPressHeadsConfig, build=build_xpress, step_loss=xpress_step_loss,
    eval_sums=xpress_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

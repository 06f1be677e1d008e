"""The DSpark objective (`specheads.train.block_objective`, the DFlash objective's blocks): the d-th drafted slot of a
block anchored at a learns the target's distribution at position a+d (the token x_{a+d+1}), its logits carrying the
Markov bias of its previous token taken from the text (teacher forcing: x_{a+d}, the anchor for d = 0), by
`heads.loss` over the draft vocabulary with the slot weights of `heads.position_weighting`. The confidence head
learns each slot's acceptance rate Σ_v min(p_v, q_v) (the overlap of the target's p and the drafter's q, held
constant) by binary cross-entropy, weighted exp(-d / position_decay) and averaged over the counted slots, and that
loss is added `confidence_head_alpha` times (speculators' dspark metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specheads.heads.dspark import KIND_NAME, DSparkBlock, DSparkConfig, DSparkHead
from specheads.heads.fused_head import declared_by
from specheads.train.block_objective import (
    BlockStep,
    BlockTraining,
    block_eval,
    block_loss,
    block_step,
    block_tokens,
)
from specheads.train.chain_loss import chain_eval_row
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective
from specheads.train.position_weights import acceptance, decay_weights


@dataclass(frozen=True)
class DSparkHeadsConfig(FusedHeadsConfig, DSparkBlock, BlockTraining):
    """The `heads:` section of a dspark recipe: the drafter's shape (`DSparkBlock`: block_size, mask_token_id,
    sample_from_anchor, the Markov bias and the confidence head) and the objective's settings (`BlockTraining`)."""

    confidence_head_alpha: float = 1.0  # weight of the confidence head's loss

    def _check(self) -> None:
        if self.confidence_head_alpha < 0:
            raise ValueError(f"heads.confidence_head_alpha must be >= 0, got {self.confidence_head_alpha}")


def build_dspark(settings: DSparkHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> DSparkHead:
    config = DSparkConfig(**settings.head_fields(target, draft_vocab), **declared_by(DSparkBlock, settings))
    return DSparkHead(config, target)  # a mask token of None is chosen for the target here


def teacher_forced(step: BlockStep, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The entries' draft logits [M, Vd] with the Markov bias of the text's previous tokens, and their confidence
    logits [M] (None without a confidence head)."""
    model: DSparkHead = step.model
    text = block_tokens(input_ids, step.anchors, model.config.block_size)  # [B, n, block]
    normed, mix, emb = model.slot_parts(step.outputs, model.previous_tokens(text.flatten(0, 1)).view(text.shape))

    def entries(x: torch.Tensor | None) -> torch.Tensor | None:  # [B, n, block, ...] -> [M, ...]
        return None if x is None else x[:, :, model.config.first_slot:][step.valid]

    normed, emb = entries(normed), entries(emb)
    return model.slot_logits(normed, entries(mix)), model.confidence_logits(normed, emb)


def confidence_loss(confidence: torch.Tensor, target_logits: torch.Tensor, draft_logits: torch.Tensor,
                    depth: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary cross-entropy of confidence logits [M] against each entry's acceptance rate Σ min(p, q) (from the
    target's and the drafter's logits [M, Vd], no gradient), entry weights exp(-depth / gamma) (depth [M] from 0),
    averaged over the entries; and the acceptance rates [M]."""
    accept = acceptance(target_logits, draft_logits.detach())  # [M]
    bce = F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")
    return (decay_weights(depth + 1, gamma) * bce).sum() / max(bce.numel(), 1), accept


def dspark_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: DSparkHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    step = block_step(head, target, batch, settings.max_anchors, settings.feature_noise)
    logits, confidence = teacher_forced(step, batch["input_ids"])
    loss, stats = block_loss(step, logits, settings.loss, settings)
    if confidence is not None:
        depth = torch.arange(step.valid.shape[2], device=logits.device).expand_as(step.valid)[step.valid]  # [M]
        extra, accept = confidence_loss(confidence, step.target_logits, logits, depth, settings.position_decay)
        loss = loss + settings.confidence_head_alpha * extra
        stats["loss_confidence"] = float(extra.detach())
        if accept.numel():
            stats["confidence_error"] = float((confidence.detach().float().sigmoid() - accept).abs().mean())
    return loss, stats


def dspark_eval(head: torch.nn.Module, target: torch.nn.Module,
                batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`block_eval` with every slot's Markov bias from the text's previous token."""
    def slot_logits(model: DSparkHead, out: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return model.block_logits(out, model.previous_tokens(text))[0][:, model.config.first_slot:]

    return block_eval(head, target, batch, slot_logits)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=DSparkHeadsConfig, build=build_dspark, step_loss=dspark_step_loss,
    eval_sums=dspark_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

"""The DFlash2 objective (`specheads.train.block_objective`, the DFlash objective's blocks) with speculators' dflash2
selector loss. The d-th drafted slot of a block anchored at a learns the target's distribution at position a+d by
`heads.loss` over the target's vocabulary (the unary logits, the slot weights of `heads.position_weighting`). The
candidate selector learns a k-way choice: its candidates are the unary logits' top-k (`selector_top_k`), the last
one replaced by the target's argmax where that is missing (so every entry has a label), and its scores, fed the
text's previous token (teacher forcing), are trained by cross-entropy against the target's argmax, with the same slot
weights (under `dpace` its confidences are the selector's probability of the label), added `selector_loss_alpha`
times. The scores add to the unary logits, so that loss trains the drafter's layers too.

Evaluation ranks each slot's tokens as decoding does: the selector's candidates by score, then the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specheads.heads.dflash2 import KIND_NAME, DFlash2Block, DFlash2Config, DFlash2Head
from specheads.heads.fused_head import declared_by
from specheads.train.block_objective import (
    BlockStep,
    BlockTraining,
    block_eval,
    block_loss,
    block_step,
    block_tokens,
    require_full_vocabulary,
)
from specheads.train.chain_loss import chain_eval_row
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective


@dataclass(frozen=True)
class DFlash2HeadsConfig(FusedHeadsConfig, DFlash2Block, BlockTraining):
    """The `heads:` section of a dflash2 recipe: the drafter's shape (`DFlash2Block`: block_size, mask_token_id,
    sample_from_anchor, the convolutions and the selector) and the objective's settings (`BlockTraining`)."""

    selector_loss_alpha: float = 1.0  # weight of the selector's k-way cross-entropy

    def _check(self) -> None:
        if self.selector_loss_alpha < 0:
            raise ValueError(f"heads.selector_loss_alpha must be >= 0, got {self.selector_loss_alpha}")


def build_dflash2(settings: DFlash2HeadsConfig, target: torch.nn.Module,
                  draft_vocab: list[int] | None = None) -> DFlash2Head:
    config = DFlash2Config(**settings.head_fields(target, draft_vocab), **declared_by(DFlash2Block, settings))
    return DFlash2Head(config, target)  # a mask token of None is chosen for the target here


def check_dflash2_config(settings: DFlash2HeadsConfig, cfg: Any) -> None:
    require_full_vocabulary(cfg, KIND_NAME, "scores the target's whole vocabulary with its own LM head, as "
                                            "speculators' dflash2 requires")


@dataclass
class SelectorEntries:
    """The entries' (`BlockStep` order) unary logits and what the selector makes of them, teacher forced."""

    unary: torch.Tensor  # [M, V] the unary logits
    candidates: torch.Tensor  # [M, k] the unary top-k, the last replaced by the label where the top-k misses it
    scores: torch.Tensor  # [M, k] the selector's scores of the candidates
    label: torch.Tensor  # [M] the label's place among the candidates
    recalled: torch.Tensor  # [M] bool: the unary top-k holds the label (as it must for decoding to draft it)


def selector_candidates(top: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unary top-k ids [M, k] and the labels [M] -> the training candidates [M, k] (the last replaced by the
    label where missing), the label's place [M], and whether the top-k held it [M]."""
    hits = top == label[:, None]
    recalled = hits.any(-1)
    place = torch.where(recalled, hits.long().argmax(-1), top.shape[-1] - 1)
    candidates = top.clone()
    candidates[:, -1] = torch.where(recalled, top[:, -1], label)
    return candidates, place, recalled


def teacher_forced(step: BlockStep, input_ids: torch.Tensor) -> SelectorEntries:
    """The entries' unary logits and the selector's candidates and scores after the text's previous tokens."""
    model: DFlash2Head = step.model
    block, first = model.config.block_size, model.config.first_slot
    text = block_tokens(input_ids, step.anchors, block)  # [B, n, block]
    prev = model.previous_tokens(text.flatten(0, 1)).view(text.shape)[:, :, first:][step.valid]  # [M]
    normed = model.norm(step.outputs[:, :, first:][step.valid])  # [M, H]
    unary = model.lm_head(normed)
    label = step.target_logits.argmax(-1)  # the target's choice (the whole vocabulary: no draft ids)
    candidates, place, recalled = selector_candidates(unary.detach().topk(model.config.selector_top_k, -1).indices,
                                                      label)
    _, scores = model.candidates(unary, normed, prev, candidates)
    return SelectorEntries(unary, candidates, scores, place, recalled)


def selector_loss(step: BlockStep, entries: SelectorEntries, settings: DFlash2HeadsConfig) -> torch.Tensor:
    """The k-way cross-entropy of the entries' scores against the label's place, weighted as the unary loss is
    (the label one-hot in the target's place)."""
    ce = F.cross_entropy(entries.scores.float(), entries.label, reduction="none")  # [M]
    hard = torch.full_like(entries.scores, float("-inf"), dtype=torch.float32).scatter_(-1, entries.label[:, None], 0.0)
    w = settings.weights(step.valid.flatten(0, 1), hard, entries.scores.detach().float())
    return (w * ce).sum() / w.sum().clamp(min=1e-9)


def dflash2_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                      settings: DFlash2HeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    step = block_step(head, target, batch, settings.max_anchors, settings.feature_noise)
    entries = teacher_forced(step, batch["input_ids"])
    loss, stats = block_loss(step, entries.unary, settings.loss, settings)
    extra = selector_loss(step, entries, settings)
    loss = loss + settings.selector_loss_alpha * extra
    stats["loss_selector"] = float(extra.detach())
    with torch.no_grad():
        if entries.recalled.numel():
            chosen = entries.scores.argmax(-1) == entries.label
            stats["candidate_recall"] = float(entries.recalled.float().mean())
            if bool(entries.recalled.any()):  # as decoding sees it: only a recalled label can be drafted
                stats["selector_top1"] = float(chosen[entries.recalled].float().mean())
    return loss, stats


def reranked(model: DFlash2Head, out: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # [..., V]
    """Every token's rank key at slots with outputs [..., H] after previous tokens [...]: the selector's candidates
    by score, above the rest by unary logit."""
    normed = model.norm(out)
    unary = model.lm_head(normed).float()
    candidates, scores = model.candidates(unary, normed, prev)
    rest = unary - unary.amax(-1, keepdim=True) + scores.amin(-1, keepdim=True) - 1.0  # below every candidate
    return rest.scatter(-1, candidates, scores)


def dflash2_eval(head: torch.nn.Module, target: torch.nn.Module,
                 batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`block_eval` with every slot's tokens ranked by the selector after the text's previous token."""
    def slot_logits(model: DFlash2Head, out: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        first = model.config.first_slot
        return reranked(model, out[:, first:], model.previous_tokens(text)[:, first:])

    return block_eval(head, target, batch, slot_logits)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=DFlash2HeadsConfig, build=build_dflash2, step_loss=dflash2_step_loss,
    eval_sums=dflash2_eval, eval_row=chain_eval_row, check=check_dflash2_config,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

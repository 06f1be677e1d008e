"""The Domino objective (`specheads.train.block_objective`, the DFlash objective's blocks, the anchor's slot drafting
too): the d-th drafted slot of a block anchored at a learns the target's distribution at position a+d by `heads.loss`
over the whole vocabulary, twice, with speculators' and SpecForge's curriculum anchored on the base logits:

    loss = (1 - λ) · L_final + λ · L_base        λ = lambda_base_start · (1 - min(progress / ratio, 1))

- L_base: DFlash's logits alone (`lm_head(norm(h))`), the ones decoding starts every slot from;
- L_final: the logits the correction refines from `pure_draft_prefix_len` on, its GRU fed the embeddings of the text's
  own previous tokens (the anchor, then the text's continuation; teacher forcing), every block's slots in one pass;
- λ falls linearly from `lambda_base_start` to 0 over `lambda_base_decay_ratio` of the run (ratio 0: λ stays at its
  start), so the backbone learns to draft alone before the correction takes over the loss. `progress` is the share of
  the run's budget spent (`TrainingClock.run_progress`): its steps (speculators' schedule, there counted in whole
  steps) or, under `max_minutes`, its minutes where they are further along, so a run its minutes stop ends at λ = 0.

Both terms take the slot weights of `heads.position_weighting`. With `heads.accept_until_fail` only L_base is cut at
each block's first failure, its test on the base logits' argmax; L_final keeps every counted slot (speculators'
"B-AUF+D"). The refined logits give the per-slot top-1 (what decoding drafts); evaluation drafts them teacher forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specheads.heads.domino import KIND_NAME, DominoBlock, DominoConfig, DominoHead
from specheads.heads.fused_head import declared_by
from specheads.train.block_objective import (
    BlockStep,
    BlockTraining,
    block_eval,
    block_loss,
    block_step,
    block_tokens,
    drafted_outputs,
    require_full_vocabulary,
)
from specheads.train.chain_loss import chain_eval_row
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective
from specheads.train.position_weights import PositionWeighting


@dataclass(frozen=True)
class DominoHeadsConfig(FusedHeadsConfig, DominoBlock, BlockTraining):
    """The `heads:` section of a domino recipe: the drafter's shape (`DominoBlock`: block_size, mask_token_id, the GRU
    and the correction) and the objective's settings (`BlockTraining` and the curriculum, speculators' defaults)."""

    lambda_base_start: float = 1.0  # λ, the base logits' share of the loss, at the first step
    lambda_base_decay_ratio: float = 1.0  # share of the run (steps or minutes) over which λ falls to 0 (0: stays)

    def _check(self) -> None:
        for key in ("lambda_base_start", "lambda_base_decay_ratio"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"heads.{key} must be in [0, 1] (speculators' range), got {getattr(self, key)}")

    def lambda_base(self, progress: float) -> float:
        """λ once `progress` (0 -> 1) of the run is spent: from lambda_base_start linearly to 0 over
        lambda_base_decay_ratio of it, 0 after; a ratio of 0 holds it at its start (speculators'
        `_compute_domino_metrics`, over steps)."""
        if self.lambda_base_decay_ratio <= 0:
            return self.lambda_base_start
        return self.lambda_base_start * (1.0 - min(progress / self.lambda_base_decay_ratio, 1.0))


def build_domino(settings: DominoHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> DominoHead:
    config = DominoConfig(**settings.head_fields(target, draft_vocab), **declared_by(DominoBlock, settings))
    return DominoHead(config, target)  # a mask token of None is chosen for the target here


def check_domino_config(settings: DominoHeadsConfig, cfg: Any) -> None:
    require_full_vocabulary(cfg, KIND_NAME, "corrects logits over the target's whole vocabulary, as speculators' "
                                            "Domino requires")


def record_progress(model: DominoHead, progress: float) -> None:
    """The recipe's share of the run spent, which λ follows (a drafter outside a run stays at 0: λ at its start)."""
    model.run_progress = progress


@dataclass
class DominoEntries:
    """The entries' (`BlockStep` order) logits of both branches."""

    base: torch.Tensor  # [M, V] DFlash's logits alone
    refined: torch.Tensor  # [M, V] with the correction from suffix_start on, teacher forced


def domino_entries(step: BlockStep, input_ids: torch.Tensor) -> DominoEntries:
    model: DominoHead = step.model
    block = model.config.block_size
    normed = model.norm(drafted_outputs(step))  # [M, H]
    base = model.lm_head(normed)
    # slot s's previous token is the text's at a+s (the anchor for slot 0): the GRU runs over every block at once
    states = model.gru_states(block_tokens(input_ids, step.anchors, block))[step.valid]  # [M, G]
    slot = torch.arange(block, device=base.device).expand_as(step.valid)[step.valid]  # [M]
    late = (slot >= model.config.suffix_start)[:, None]
    return DominoEntries(base, torch.where(late, model.corrected(base, normed, states), base))


def full_support(settings: DominoHeadsConfig) -> PositionWeighting:
    """The slot weights without the cut at the first failure: what the refined branch always trains on."""
    if not settings.accept_until_fail:
        return settings
    return PositionWeighting(**{**declared_by(PositionWeighting, settings), "accept_until_fail": False})


def domino_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: DominoHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    step = block_step(head, target, batch, settings.max_anchors, settings.feature_noise)
    lam = settings.lambda_base(step.model.run_progress)
    entries = domino_entries(step, batch["input_ids"])
    base, base_stats = block_loss(step, entries.base, settings.loss, settings)  # AUF (when on): on the base argmax
    final, stats = block_loss(step, entries.refined, settings.loss, full_support(settings))
    loss = (1.0 - lam) * final + lam * base
    stats |= {"loss_final": float(final.detach()), "loss_base": float(base.detach()), "lambda_base": lam,
              "top1_base": base_stats["top1"]}
    if "auf_kept" in base_stats:
        stats["auf_kept"] = base_stats["auf_kept"]
    return loss, stats


def domino_eval(head: torch.nn.Module, target: torch.nn.Module,
                batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`block_eval` of the refined logits, the GRU fed the text's previous tokens."""
    def slot_logits(model: DominoHead, out: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return model.teacher_forced_logits(model.norm(out), text)

    return block_eval(head, target, batch, slot_logits)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=DominoHeadsConfig, build=build_domino, step_loss=domino_step_loss,
    eval_sums=domino_eval, eval_row=chain_eval_row, check=check_domino_config,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
    run_progress=record_progress,
))

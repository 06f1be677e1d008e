"""The Domino objective (`specheads.train.block_objective`, the DFlash objective's blocks, the anchor's slot drafting
too): the d-th drafted slot of a block anchored at a learns the target's distribution at position a+d by `heads.loss`
over the whole vocabulary, twice, with speculators' and SpecForge's curriculum anchored on the base logits:

    loss = (1 - λ) · L_final + λ · L_base        λ = lambda_base_start · (1 - min(step / (ratio · max_steps), 1))

- L_base: DFlash's logits alone (`lm_head(norm(h))`), the ones decoding starts every slot from;
- L_final: the logits the correction refines from `pure_draft_prefix_len` on, its GRU fed the embeddings of the text's
  own previous tokens (the anchor, then the text's continuation; teacher forcing), every block's slots in one pass;
- λ falls linearly from `lambda_base_start` to 0 over `lambda_base_decay_ratio` of the run's optimizer steps (ratio
  0: λ stays at its start), so the backbone learns to draft alone before the correction takes over the loss.

Both terms take the slot weights of `heads.position_weighting`. With `heads.accept_until_fail` only L_base is cut at
each block's first failure, its test on the base logits' argmax; L_final keeps every counted slot (speculators'
"B-AUF+D"). The refined logits give the per-slot top-1 (what decoding drafts); evaluation drafts them teacher forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
    lambda_base_decay_ratio: float = 1.0  # share of max_steps over which λ falls linearly to 0 (0: λ stays at start)

    # The run's (max_steps, optim.grad_accum), which λ's schedule spans. Not a `heads:` key: the run's budget is the
    # config's own (and may grow on a resume), so the recipe's check of the whole config records it here
    # (`check_domino_config`); None outside a run, where λ stays at lambda_base_start. The schedule counts steps, so a
    # run that max_minutes stops first ends with λ where its steps left it.
    run_budget: ClassVar[tuple[int, int] | None] = None

    def _check(self) -> None:
        for key in ("lambda_base_start", "lambda_base_decay_ratio"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"heads.{key} must be in [0, 1] (speculators' range), got {getattr(self, key)}")

    def lambda_base(self, step: int) -> float:
        """λ at optimizer step `step` (0: the first) of the recorded run."""
        if self.run_budget is None:
            return self.lambda_base_start
        return lambda_schedule(step, self.run_budget[0], self.lambda_base_start, self.lambda_base_decay_ratio)


def lambda_schedule(step: int, max_steps: int, start: float, decay_ratio: float) -> float:
    """λ_base at optimizer step `step` of `max_steps`: from `start` linearly to 0 over decay_ratio · max_steps steps
    (at least one), 0 after; a ratio of 0 holds it at `start` (speculators' `_compute_domino_metrics`)."""
    if decay_ratio <= 0:
        return start
    progress = min(step / max(1, int(max_steps * decay_ratio)), 1.0)
    return max(0.0, min(1.0, start * (1.0 - progress)))


def build_domino(settings: DominoHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> DominoHead:
    config = DominoConfig(**settings.head_fields(target, draft_vocab), **declared_by(DominoBlock, settings))
    return DominoHead(config, target)  # a mask token of None is chosen for the target here


def check_domino_config(settings: DominoHeadsConfig, cfg: Any) -> None:
    require_full_vocabulary(cfg, KIND_NAME, "corrects logits over the target's whole vocabulary, as speculators' "
                                            "Domino requires")
    object.__setattr__(settings, "run_budget", (cfg.max_steps, cfg.optim.grad_accum))


def next_lambda(model: DominoHead, settings: DominoHeadsConfig) -> float:
    """λ for this step loss, advancing the count of step losses.

    The objective's step loss is handed no step number, so the drafter counts its own calls in a buffer
    (`DominoHead.trained_batches`): the recipe's checkpoints save the module's state dict, buffers included, so a
    resumed run carries on where its schedule stood, while the drafter's own checkpoint and exports leave the buffer
    out (a fine-tune from saved heads starts its own schedule). A call is a batch: `optim.grad_accum` of them make
    one optimizer step, the schedule's unit."""
    accum = 1 if settings.run_budget is None else settings.run_budget[1]
    with torch.no_grad():
        done = int(model.trained_batches)
        model.trained_batches += 1
    return settings.lambda_base(done // accum)


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
    lam = next_lambda(step.model, settings)
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
))

"""The EAGLE-3 objective: the chain loss of `eagle.py` with the draft head's own LM head and no feature term.

EAGLE-3 drafts tokens, not features: its loss is the soft cross-entropy of each unrolled draft step
(training-time test) against the target's distribution over the draft vocabulary, step k weighted
ttt_decay**k. Evaluation is the same per-step agreement and simulated chain τ as EAGLE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.eagle3 import KIND_NAME, Eagle3Config, Eagle3Head, default_aux_layers
from specheads.train.eagle import chain_eval, chain_eval_row, chain_loss
from specheads.train.objective import Objective, register_objective


@dataclass(frozen=True)
class FusedHeadsConfig:
    """The `heads:` keys of every head that fuses target layers through `fc` (eagle3, peagle, dflash)."""

    num_layers: int = 1  # decoder layers in the head (eagle3's first reads cat(embedding, fused features))
    aux_layers: tuple[int, ...] | None = None  # target hidden_states fused by fc; None: 2, L//2, L-3 (speculators' default)
    feature_noise: float = 0.0  # uniform noise of this amplitude on input features (regularisation)

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"heads.num_layers must be >= 1, got {self.num_layers}")
        if self.aux_layers is not None:
            object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
            if not self.aux_layers:
                raise ValueError("heads.aux_layers must name at least one target layer, or be null for 2, L//2, L-3")
        if self.feature_noise < 0:
            raise ValueError(f"heads.feature_noise must be >= 0, got {self.feature_noise}")

    def resolved_aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return self.aux_layers if self.aux_layers is not None else default_aux_layers(num_target_layers)

    def head_fields(self, target: torch.nn.Module, draft_vocab: list[int] | None) -> dict:
        """The head config's fields these settings and the target fix (an Eagle3Config's, or a subclass's)."""
        tcfg = target.config.get_text_config()
        return {"hidden_size": tcfg.hidden_size, "vocab_size": target.get_output_embeddings().weight.shape[0],
                "aux_layers": self.resolved_aux_layers(tcfg.num_hidden_layers), "num_layers": self.num_layers,
                "draft_vocab": None if draft_vocab is None else tuple(draft_vocab)}


@dataclass(frozen=True)
class Eagle3HeadsConfig(FusedHeadsConfig):
    """The `heads:` section of an eagle3 recipe: the head's shape and the objective's settings."""

    norm_before_residual: bool = False  # see specheads.heads.eagle3
    norm_output: bool = False  # later draft steps read the post-norm output
    ttt_steps: int = 3  # draft steps unrolled in training, each fed the previous step's outputs
    ttt_decay: float = 0.8  # loss weight of unrolled step k is ttt_decay**k

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"heads.ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"heads.ttt_decay must be in (0, 1], got {self.ttt_decay}")


def build_eagle3(settings: Eagle3HeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> Eagle3Head:
    return Eagle3Head(Eagle3Config(**settings.head_fields(target, draft_vocab), norm_output=settings.norm_output,
                                   norm_before_residual=settings.norm_before_residual), target)


def eagle3_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: Eagle3HeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    return chain_loss(head, target, batch, ttt_steps=settings.ttt_steps, ttt_decay=settings.ttt_decay,
                      feature_noise=settings.feature_noise)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=Eagle3HeadsConfig, build=build_eagle3, step_loss=eagle3_step_loss,
    eval_sums=chain_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))

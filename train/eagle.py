"""The EAGLE objective: the chain loss (`specheads.train.chain_loss`) with a feature term, and its evaluation.

With `heads.ttt_steps = K > 1` the head is trained as it is used ("training-time test", EAGLE-3): step k feeds
the head its own step k-1 outputs as features (`chain_loss.unroll`); `reg_weight` adds EAGLE-1's SmoothL1 between
each output and the target's next feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specheads.heads.eagle import KIND_NAME, EagleConfig, EagleHead
from specheads.train.chain_loss import chain_eval, chain_eval_row, chain_loss
from specheads.train.objective import Objective, register_objective


@dataclass(frozen=True)
class EagleHeadsConfig:
    """The `heads:` section of an eagle recipe: the head's shape and the objective's weights."""

    RENAMED: ClassVar[dict[str, str]] = {"eagle_layers": "num_layers"}

    num_layers: int = 1  # decoder layers in the head
    init_from_target_layer: int | None = None  # copy this target layer into the head (None: random init, learns faster)
    aux_layers: tuple[int, ...] = ()  # target hidden_states also fed to the head (EAGLE-3: 2, L//2, L-3); () = EAGLE-1
    first_layer_norm: bool = True  # false: EAGLE-1's original layout (no first input norm), exportable to SGLang
    cls_weight: float = 0.1  # weight of the soft cross-entropy next to the feature SmoothL1 loss
    reg_weight: float = 1.0  # weight of the feature SmoothL1 loss (EAGLE-3 drops it: 0 with cls_weight 1)
    feature_noise: float = 0.0  # uniform noise of this amplitude on input features (regularisation)
    ttt_steps: int = 1  # draft steps unrolled in training, each fed the previous step's outputs (1 = EAGLE-1)
    ttt_decay: float = 0.8  # loss weight of unrolled step k is ttt_decay**k

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"heads.num_layers must be >= 1, got {self.num_layers}")
        if self.ttt_steps < 1:
            raise ValueError(f"heads.ttt_steps must be >= 1 (1 trains plain EAGLE-1), got {self.ttt_steps}")
        if self.cls_weight < 0 or self.reg_weight < 0 or self.cls_weight + self.reg_weight == 0:
            raise ValueError("heads.cls_weight and heads.reg_weight must be >= 0, and not both 0")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"heads.ttt_decay must be in (0, 1], got {self.ttt_decay}")
        if self.feature_noise < 0:
            raise ValueError(f"heads.feature_noise must be >= 0, got {self.feature_noise}")


def build_eagle(settings: EagleHeadsConfig, target: torch.nn.Module, draft_vocab: list[int] | None = None) -> EagleHead:
    tcfg = target.config.get_text_config()
    vocab = target.get_output_embeddings().weight.shape[0]
    # The draft LM head scores only the draft vocabulary at inference, so training spends its CE there too.
    head_cfg = EagleConfig(hidden_size=tcfg.hidden_size, vocab_size=vocab, num_layers=settings.num_layers,
                           init_from_target_layer=settings.init_from_target_layer,
                           draft_vocab=None if draft_vocab is None else tuple(draft_vocab),
                           aux_layers=settings.aux_layers, first_layer_norm=settings.first_layer_norm)
    return EagleHead(head_cfg, target)


def eagle_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                    settings: EagleHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    return chain_loss(head, target, batch, ttt_steps=settings.ttt_steps, ttt_decay=settings.ttt_decay,
                      feature_noise=settings.feature_noise, cls_weight=settings.cls_weight,
                      reg_weight=settings.reg_weight)


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=EagleHeadsConfig, build=build_eagle, step_loss=eagle_step_loss,
    eval_sums=chain_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.aux_layers,
))

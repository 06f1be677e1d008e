"""Training objectives: what the one recipe (`recipe.py`) needs from each drafter kind, by recipe name.

A drafter kind (`specheads.kinds`) becomes trainable by registering an `Objective` here, from its own
file in `specheads.train` (see `builtin.py` for the built-in ones). The recipe's loop, data,
features, checkpoints and measured τ are shared; an objective supplies only the kind's parts:
its settings (the YAML `heads:` section, or the one `section` names), how to build the module, one
step's loss, evaluation, and how its final drafter is saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specheads.registry import Registry


def _own_config(module: nn.Module, eval_extra: Any) -> Any:
    return module.config


def _no_aux_layers(settings: Any, num_target_layers: int) -> tuple[int, ...]:
    return ()


def _no_check(settings: Any, train_config: Any) -> None:
    pass


def one_group(module: nn.Module, lr: float, settings: Any) -> list[dict[str, Any]]:
    """Every trainable parameter of `module` at the run's learning rate."""
    return [{"params": [p for p in module.parameters() if p.requires_grad], "lr": lr}]


def save_heads(module: nn.Module, folder: Path, *, target: nn.Module, tokenizer: Any, target_name: str, config: Any,
               metadata: dict[str, Any]) -> None:
    """The kind's heads checkpoint (`specheads.heads.checkpoint`): what heads recipes save as final/."""
    from specheads.heads.checkpoint import TargetInfo, save_drafter

    save_drafter(folder, module, TargetInfo.from_model(target, target_name), config=config, metadata=metadata)


@dataclass(frozen=True)
class Objective:
    name: str  # the recipe name (`recipe:` in a YAML config)
    kind: str  # the drafter kind it trains (`specheads.kinds.KINDS`): checkpoint format and decoding method
    settings: type  # frozen dataclass of the recipe's `heads:` section (field comments are its docs)
    # (settings, target, draft_vocab or None) -> the module to train; built under the run's seed
    build: Callable[[Any, nn.Module, list[int] | None], nn.Module]
    # (module, possibly DDP-wrapped; target; batch; settings) -> (loss, {metric: float}); must include "top1"
    step_loss: Callable[[nn.Module, nn.Module, dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict[str, float]]]
    # (module, target, batch) -> {name: tensor} summed over batches and processes; optionally with a
    # `class_top1.TokenHits` under `class_top1.TOKEN_HITS`, which the recipe reports as top-1 by token class
    eval_sums: Callable[[nn.Module, nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    # (summed tensors) -> ({"eval/...": float}, extra handed to `final_config`)
    eval_row: Callable[[dict[str, torch.Tensor]], tuple[dict[str, float], Any]]
    # (module, the last evaluation's extra) -> the kind's config saved in final/ (e.g. with a measured tree)
    final_config: Callable[[nn.Module, Any], Any] = _own_config
    # (settings, the target's layer count) -> the target hidden_states indices the features carry besides the last
    # layer (the feature cache's layout)
    feature_layers: Callable[[Any, int], tuple[int, ...]] = _no_aux_layers
    # (module, folder, *, target, tokenizer, target_name, config, metadata) -> None: writes final/
    save: Callable[..., None] = save_heads
    section: str = "heads"  # the YAML section of `settings` (`drafter:` for standalone draft models)
    # (settings, the whole TrainConfig) -> None, or ValueError naming the fix: what the settings need of the rest
    check: Callable[[Any, Any], None] = _no_check
    # (module, optim.lr, settings) -> the optimizer's parameter groups (torch.optim dicts; each group's "lr" is its
    # peak, which the schedule scales alike): how parts of the module train at different rates
    param_groups: Callable[[nn.Module, float, Any], list[dict[str, Any]]] = one_group
    # (settings) -> None, or ValueError naming the fix: whether the module can train partitioned over the processes
    # (DeepSpeed ZeRO-3, `sharding.py`). It must register no module it shares with the target (the target stays
    # whole) and run the same forwards in every process (gathering a layer's weights is collective).
    check_partitioned: Callable[[Any], None] | None = None
    # (module, the share of the run's budget spent, 0 -> 1) -> None: called before each optimizer step's losses, for a
    # loss that follows the run's schedule (Domino's curriculum); the share counts steps or minutes, whichever is
    # further along (`TrainingClock.run_progress`), so a resumed run goes on from its checkpoint's step and minutes
    run_progress: Callable[[nn.Module, float], None] | None = None

    @property
    def decodes_as_saved(self) -> bool:
        """Its drafter, saved mid-run, decodes as the final one would (no config made from an evaluation): what
        the on-policy phase's rollouts need."""
        return self.trains_heads and self.final_config is _own_config

    @property
    def trains_heads(self) -> bool:
        """Heads checkpoints (`init_heads` applies) rather than a standalone model folder."""
        return self.save is save_heads

    def __post_init__(self) -> None:
        if not is_dataclass(self.settings):
            raise TypeError(f"objective {self.name!r}: settings must be a dataclass, got {self.settings!r}")


OBJECTIVES: Registry[Objective] = Registry("recipe", builtins="specheads.train.builtin")


def register_objective(objective: Objective) -> Objective:
    return OBJECTIVES.register(objective.name, objective)

"""Checks the launch's distributed settings against the recipe's config, before the run writes anything.

The recipe owns the optimizer (AdamW) and its LR schedule, and its `optim:` section owns the batch size per
process, gradient accumulation and clipping. An accelerate or DeepSpeed config can set these too, and where
both do, the launch's value silently wins (DeepSpeed accumulates and clips by its own config, and accelerate
reads gradient accumulation from the launcher's environment): the run would train with settings its saved
config.yaml does not show. So a launch that sets any of them differently is refused, naming the fix.

DeepSpeed ZeRO-3 partitions the trained model's parameters (`sharding.py`) where its objective allows it (a
standalone draft model; heads share modules with the target and are small enough for ZeRO-2). FSDP is refused:
the recipe's evaluation calls the trained model's own modules, outside the FSDP wrapper that gathers their sharded
weights; ZeRO-3 (whose gathering hooks sit on every module) covers the same need.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from specheads.train.config import OptimConfig, TrainConfig
from specheads.train.objective import Objective

AUTO = "auto"  # a DeepSpeed-config value accelerate fills from the prepared objects
SHARDING_FIX = ("use configs/accelerate/deepspeed_zero2.yaml (shards the drafter's gradients and optimizer state) or "
                "multi_gpu_ddp.yaml")
ZERO3_FIX = "configs/accelerate/deepspeed_zero3.yaml (for a distill recipe)"


def check_deepspeed_config(ds_config: MutableMapping[str, Any], optim: OptimConfig, num_processes: int) -> None:
    """Raise ValueError if the DeepSpeed config contradicts the recipe; give DeepSpeed the recipe's clipping.

    Under DeepSpeed the engine clips gradients by its config's `gradient_clipping` and the recipe's
    `accelerator.clip_grad_norm_` only reads the norm: an "auto" value would be filled with accelerate's 1.0,
    and an absent one means no clipping, so both become `optim.max_grad_norm` here (in place)."""
    for section in ("optimizer", "scheduler"):
        if section in ds_config:
            raise ValueError(f"the DeepSpeed config defines '{section}', but the recipe builds its own (AdamW with a "
                             f"cosine schedule, set in optim:); remove the '{section}' section from the DeepSpeed "
                             "config")
    expected = {
        "train_micro_batch_size_per_gpu": (optim.batch_size, "optim.batch_size"),
        "gradient_accumulation_steps": (optim.grad_accum, "optim.grad_accum"),
        "train_batch_size": (optim.batch_size * optim.grad_accum * num_processes,
                             f"optim.batch_size x optim.grad_accum x {num_processes} processes"),
        "gradient_clipping": (optim.max_grad_norm, "optim.max_grad_norm"),
    }
    for key, (want, source) in expected.items():
        if ds_config.get(key, AUTO) not in (AUTO, want):
            raise ValueError(f"the DeepSpeed config sets {key}={ds_config[key]}, but the recipe's {source} gives "
                             f"{want}; remove {key} from the accelerate config's deepspeed_config (in a DeepSpeed "
                             "json: set it to \"auto\") and set it in the recipe's optim: section")
    ds_config["gradient_clipping"] = optim.max_grad_norm


def check_partitioned(objective: Objective, settings: object) -> None:
    """Raise ValueError, naming the fix, if the objective's module cannot train partitioned (ZeRO-3)."""
    if objective.check_partitioned is None:
        raise ValueError(f"DeepSpeed ZeRO-3 partitions the trained model, but the {objective.name} recipe's heads "
                         f"share the frozen target's modules, which stay whole; {SHARDING_FIX}")
    objective.check_partitioned(settings)


def check_launch(accelerator: Accelerator, cfg: TrainConfig, objective: Objective) -> None:
    """Raise ValueError, naming the fix, if the launch overrides what the recipe's config sets or partitions what
    cannot be (see the module doc)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError("FSDP is not supported: the recipe evaluates the trained model through its own modules, "
                         f"outside the FSDP wrapper that gathers their weights; {SHARDING_FIX}, or {ZERO3_FIX}; "
                         "to shard the target, launch multi_gpu_ddp.yaml with shard_target=true")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        if cfg.optim.optimizer == "muon":  # ZeRO hands each process a slice of a matrix; Muon needs the whole one
            raise ValueError("optim.optimizer=muon orthogonalises whole matrices, which DeepSpeed's ZeRO partitions "
                             "across processes; set optim.optimizer=adamw, or launch multi_gpu_ddp.yaml")
        check_deepspeed_config(plugin.deepspeed_config, cfg.optim, accelerator.num_processes)
        if plugin.deepspeed_config.get("zero_optimization", {}).get("stage") == 3:
            check_partitioned(objective, cfg.heads)
    if accelerator.gradient_accumulation_steps != cfg.optim.grad_accum:
        raise ValueError(f"the launch sets gradient accumulation to {accelerator.gradient_accumulation_steps} "
                         f"(ACCELERATE_GRADIENT_ACCUMULATION_STEPS), but the recipe's optim.grad_accum is "
                         f"{cfg.optim.grad_accum}; unset it in the launch and set optim.grad_accum instead")

"""A frozen target too large for one device, sharded over the training processes with FSDP2 (`fully_shard`).

With `shard_target: true`, each decoder layer of the target is split across the N processes of the launch: a
process holds 1/N of every layer's weights and gathers a layer's whole weights only for that layer's forward
(FSDP2's all-gather, freed again after it), so the target's decoder takes 1/N of its memory per device, plus one
layer at a time. The embeddings, the final norm and the LM head stay whole on every process: heads read
embedding rows and the LM head's rows directly, and for large targets they are a small part of the weights.

What this asks of the run: every process runs the target's forward the same number of times, since each layer's
gather is collective. The training steps and evaluation do (accelerate hands every process equal batch counts),
the offline feature cache pads each process's share to the longest share's forward count, and the measured τ of
the final drafter (which decodes on one process) is refused: measure it with `specheads bench` where the target
fits whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config checks its settings without importing torch
    from accelerate import Accelerator
    from torch import nn


@dataclass(frozen=True)
class TargetShards:
    held: int  # decoder-layer weights this process holds (elements)
    total: int  # decoder-layer weights of the whole target (elements)
    whole: int  # weights every process holds whole (embeddings, final norm, LM head; elements)


def check_shard_settings(measure_prompts: int) -> None:
    """What a config with `shard_target: true` may not ask (the config's validation calls this)."""
    if measure_prompts:
        raise ValueError("shard_target: the measured τ decodes the final drafter on one process, which cannot hold the "
                         "sharded target; set measure_prompts=0 and measure with specheads bench where it fits whole")


def check_shardable(num_processes: int) -> None:
    """A launch of `num_processes` can shard the target (the recipe calls this before the target loads)."""
    if num_processes < 2:
        raise ValueError("shard_target splits the target over the launch's processes, but this run has one; launch "
                         "with several (accelerate launch --num_processes N) or set shard_target=false")


def shard_target(target: nn.Module, accelerator: Accelerator) -> TargetShards:
    """Shard each decoder layer of the frozen `target` over every process of `accelerator` (collective: every
    process calls it). Returns what this process now holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from specheads.hf import decoder_of

    check_shardable(accelerator.num_processes)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    layers = decoder_of(target).layers
    total = sum(p.numel() for layer in layers for p in layer.parameters())
    for layer in layers:
        # gathered for its own forward and freed after it: one whole layer at a time
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    held = sum(_local(p).numel() for layer in layers for p in layer.parameters())
    whole = sum(p.numel() for p in target.parameters()) - sum(p.numel() for layer in layers for p in layer.parameters())
    return TargetShards(held=held, total=total, whole=whole)


def _local(param):  # a DTensor's own shard, else the tensor
    return param.to_local() if hasattr(param, "to_local") else param

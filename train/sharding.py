"""DeepSpeed ZeRO-3: the trained model's parameters partitioned over the processes, the frozen target whole in each.

ZeRO-3 pays off when the model being trained is itself large: a distilled draft model of a billion parameters or
more, whose fp32 weights, gradients and AdamW state would not fit beside the target in one device. The frozen
target is replicated, never partitioned: the recipe runs it outside DeepSpeed on every process's own batch, so it
must fit in one device (see docs/scale-out.md).

Two things keep that split. transformers partitions every model built while a stage-3 DeepSpeed config is
registered (its `zero.Init` integration, which accelerate enables for the whole run), the target included: the
registration is dropped once the launch is checked, so models load whole and DeepSpeed partitions only what the
recipe prepares. And reading the trained weights (saving final/) gathers them on every process for that moment,
since each process holds only its partition.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from accelerate import Accelerator
from torch import nn


def partitions_parameters(accelerator: Accelerator) -> bool:
    """Whether the launch partitions the trained model's parameters (DeepSpeed ZeRO-3)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.deepspeed_config.get("zero_optimization", {}).get("stage") == 3


def keep_models_whole(accelerator: Accelerator) -> None:
    """Under ZeRO-3, stop transformers from partitioning models as they are built (the module doc says why)."""
    if partitions_parameters(accelerator):
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


@contextmanager
def whole_parameters(accelerator: Accelerator, module: nn.Module) -> Iterator[None]:
    """Within the block, `module`'s parameters are whole on every process (read-only); every process must enter it,
    as gathering is collective."""
    if not partitions_parameters(accelerator):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(accelerator.unwrap_model(module).parameters()), modifier_rank=None):
        yield

"""LoRA adapters on the target (a `medusa2` run's final/adapter): the folder's format, and the adapted target.

The folder is what peft's `save_pretrained` writes (adapter_config.json and the adapter weights) plus TARGET_FILE,
the sizes of the target it was trained on, so an adapter for another target is refused before peft loads it. The
engine never runs peft layers: `merged_adapter` folds the adapter into the target's weights, so the adapted target
is a plain model whose greedy output the engine reproduces exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel

from specheads.heads.checkpoint import TargetInfo

ADAPTER_CONFIG = "adapter_config.json"  # peft's
TARGET_FILE = "specheads_target.json"  # ours: TargetInfo of the target the adapter was trained on


def save_adapter(peft_model: nn.Module, folder: str | Path, target: nn.Module, target_name: str) -> None:
    """peft's adapter folder for `peft_model` plus the sizes of `target` (the model under the adapters)."""
    folder = Path(folder)
    peft_model.save_pretrained(str(folder))
    info = TargetInfo.from_model(target, target_name)
    (folder / TARGET_FILE).write_text(json.dumps(info.__dict__, indent=2) + "\n", encoding="utf-8")


def check_adapter_folder(folder: str | Path) -> Path:
    """`folder` when it holds an adapter, else ValueError naming the fix (before any model loads)."""
    path = Path(folder)
    if not (path / ADAPTER_CONFIG).is_file():
        what = "does not exist" if not path.exists() else f"has no {ADAPTER_CONFIG}"
        raise ValueError(f"adapter {folder} {what}; pass a medusa2 run's final/adapter folder (peft save_pretrained)")
    return path


def merged_adapter(model: PreTrainedModel, folder: str | Path) -> PreTrainedModel:
    """`model` with the adapter in `folder` merged into its weights (in place; a plain model again), or ValueError
    naming the fix when the folder holds no adapter or one trained on another target."""
    from peft import PeftModel

    path = check_adapter_folder(folder)
    if (path / TARGET_FILE).is_file():
        trained = TargetInfo.from_dict(json.loads((path / TARGET_FILE).read_text(encoding="utf-8")), checkpoint=path)
        trained.check_sizes(TargetInfo.from_model(model, "this target"), subject=f"adapter {folder} was",
                            fix="pass the --target it was trained on", label="adapter")
    try:
        adapted = PeftModel.from_pretrained(model, str(path))
    except (ValueError, RuntimeError, KeyError, OSError) as err:  # module names or weight shapes of another model
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"adapter {folder} does not fit this target ({reason}); pass the --target it was "
                         "trained on") from None
    return adapted.merge_and_unload()

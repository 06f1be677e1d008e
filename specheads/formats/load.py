"""Reading whatever `--heads` names: our checkpoint folder, another engine's drafter folder, or a Hub id of either.

The choice lives here, beside the importers (`base.import_folder`), not in `specheads.heads.checkpoint`: the
importers build on that module, which knows only our format, so the dependency runs one way (formats on heads).
"""

from __future__ import annotations

import os

from torch import nn

from specheads.formats.base import import_folder
from specheads.heads.checkpoint import (
    Checkpoint,
    checkpoint_from_config,
    drafter_from_checkpoint,
    is_ours,
    read_config,
)
from specheads.hub import resolve_heads


def read_heads(path: str | os.PathLike, num_target_layers: int | None = None) -> Checkpoint:
    """Read a checkpoint folder of ours (any kind, format 1, 2 or 3), another engine's drafter folder (the layouts
    `specheads.formats` imports), or a Hub id of either (through huggingface_hub's cache); ValueError naming the fix
    when it is none of these. `num_target_layers` fills in foreign layouts' default aux layers."""
    folder = resolve_heads(path)
    meta = read_config(folder)
    if isinstance(meta, dict) and not is_ours(meta):
        return import_folder(folder, meta, num_target_layers)
    return checkpoint_from_config(folder, meta)


def load_heads(path: str | os.PathLike, target_model: nn.Module, *, kind: str | None = None,
               target_name: str | None = None) -> nn.Module:
    """The drafter `path` names (anything `read_heads` reads), built for `target_model` on its device, in eval
    mode, through the strict `drafter_from_checkpoint` (when `kind` is given, the drafter must be of that
    kind)."""
    ckpt = read_heads(path, num_target_layers=target_model.config.get_text_config().num_hidden_layers)
    return drafter_from_checkpoint(ckpt, target_model, kind=kind, target_name=target_name)

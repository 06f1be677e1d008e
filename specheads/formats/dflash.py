"""DFlash drafters in speculators' `dflash` layout (what vLLM serves; `specheads.formats.speculators` writes and
reads the block drafter's layout): `speculative_tokens` = block_size - 1 (the anchor is the bonus token,
`sample_from_anchor: false`); an export asking for fewer (`--speculative-tokens`) records those, more is refused.
SGLang has no DFlash loader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import block_setting, read_block_layout, write_block_layout
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.dflash import KIND_NAME, DFlashConfig

ARCHITECTURE = "DFlashSpeculator"


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    return write_block_layout(build(DFlashConfig, ckpt.config), ckpt.state, folder, ctx, architecture=ARCHITECTURE,
                              setting=block_setting(build(DFlashConfig, ckpt.config)))


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME and meta.get("projector_type", KIND_NAME) == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    if meta.get("sample_from_anchor"):
        raise ValueError(f"{folder} (speculators dflash) drafts from its anchor (sample_from_anchor: true), which "
                         "this drafter does not; use a dflash drafter trained with the anchor as the bonus token")
    return read_block_layout(folder, meta, state, num_target_layers, DFlashConfig)


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (dflash)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators dflash", 'config.json "speculators_model_type": "dflash"', _detect,
                           read_speculators))

"""XPress drafters in speculators' `xpress` layout (what vLLM serves; `specheads.formats.speculators` writes and
reads the block drafter's layout): the DFlash layout plus the causal refiner (`refiner_head.*`) under speculators'
names (speculators/models/xpress/core.py, XPressDraftModel.__init__, and model_definitions.py, XPressRefinerHead),
and its settings in the config. `speculative_tokens` is the tokens a forward drafts: block_size - 1 by default (the
anchor aside), block_size with `sample_from_anchor`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import block_setting, read_block_layout, write_block_layout
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.xpress import KIND_NAME, XPressConfig

ARCHITECTURE = "XPressSpeculator"
# The config keys of the refiner, with speculators' defaults (XPressSpeculatorConfig).
HEAD_SETTINGS = {"sample_from_anchor": False, "xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}
DRAFT_ROWS = ("refiner_head.readout.weight",)  # a row per draft token, as the LM head's


def head_names(cfg: XPressConfig) -> dict[str, tuple[int, ...]]:
    """The refiner's tensors (the DFlash layout's are `block_names`)."""
    h, r, b, m = cfg.hidden_size, cfg.xpress_rank, cfg.block_size, cfg.xpress_rank * cfg.xpress_mlp_ratio
    return {"refiner_head.token_embed.weight": (cfg.vocab_size, r), "refiner_head.down_h.weight": (r, h),
            "refiner_head.down_g.weight": (r, h), "refiner_head.in_proj.weight": (r, 3 * r),
            "refiner_head.mix_l": (r, b, b), "refiner_head.mlp_gate.weight": (m, r),
            "refiner_head.mlp_up.weight": (m, r), "refiner_head.mlp_down.weight": (r, m),
            "refiner_head.readout.weight": (cfg.draft_vocab_size, r)}


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(XPressConfig, ckpt.config)
    return write_block_layout(cfg, ckpt.state, folder, ctx, architecture=ARCHITECTURE, setting=block_setting(cfg),
                              extra_names=head_names(cfg),
                              extra_config={key: getattr(cfg, key) for key in HEAD_SETTINGS})


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    # the readout has a row per draft token, reordered with the LM head's where the draft vocabulary is not in
    # target order
    return read_block_layout(folder, meta, state, num_target_layers, XPressConfig, draft_rows=DRAFT_ROWS,
                             **{key: meta.get(key, default) for key, default in HEAD_SETTINGS.items()})


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (xpress)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators xpress", 'config.json "speculators_model_type": "xpress"', _detect,
                           read_speculators))

"""DSpark drafters in speculators' `dspark` layout (what vLLM serves; `specheads.formats.speculators` writes and
reads the block drafter's layout): the DFlash layout plus the Markov bias (`markov_head.*`) and the confidence head
(`confidence_head.proj.*`) under speculators' names (speculators/models/dspark/core.py, DSparkDraftModel.__init__,
and model_definitions.py, MarkovHead and ConfidenceHead), and their settings in the config. `speculative_tokens` is
the tokens a forward drafts: block_size with `sample_from_anchor`, else block_size - 1."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import block_setting, read_block_layout, write_block_layout
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.dspark import KIND_NAME, DSparkConfig

ARCHITECTURE = "DSparkSpeculator"
# The config keys of the Markov bias and the confidence head, with speculators' defaults (DSparkSpeculatorConfig).
HEAD_SETTINGS = {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                 "enable_confidence_head": True, "confidence_head_with_markov": True}


def head_names(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """The Markov bias's and the confidence head's tensors (the DFlash layout's are `block_names`)."""
    h, r = cfg.hidden_size, cfg.markov_rank
    names: dict[str, tuple[int, ...]] = {}
    if r > 0:
        names |= {"markov_head.markov_w1.weight": (cfg.vocab_size, r),
                  "markov_head.markov_w2.weight": (cfg.draft_vocab_size, r)}
        if cfg.markov_head_type == "gated":
            names |= {"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)}
        elif cfg.markov_head_type == "rnn":
            names |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)}
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov else 0)
        names |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return names


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(DSparkConfig, ckpt.config)
    return write_block_layout(cfg, ckpt.state, folder, ctx, architecture=ARCHITECTURE, setting=block_setting(cfg),
                              extra_names=head_names(cfg),
                              extra_config={key: getattr(cfg, key) for key in HEAD_SETTINGS})


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    # W2 has a row per draft token, reordered with the LM head's where the draft vocabulary is not in target order
    rows = ("markov_head.markov_w2.weight",) if "markov_head.markov_w2.weight" in state else ()
    return read_block_layout(folder, meta, state, num_target_layers, DSparkConfig, draft_rows=rows,
                             **{key: meta.get(key, default) for key, default in HEAD_SETTINGS.items()})


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (dspark)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators dspark", 'config.json "speculators_model_type": "dspark"', _detect,
                           read_speculators))

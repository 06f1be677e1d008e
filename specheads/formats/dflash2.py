"""DFlash2 drafters in speculators' `dflash2` layout (what vLLM serves; `specheads.formats.speculators` writes and
reads the block drafter's layout): the DFlash layout plus every layer's convolutions (`layers.{i}.attention_conv.*`,
`layers.{i}.mlp_conv.*`) and the candidate selector (`candidate_selector.*`) under speculators' names
(speculators/models/dflash2/core.py, DFlash2DraftModel.__init__, and model_definitions.py,
GroupedDynamicCausalConv, Qwen3DFlash2DecoderLayer and CandidateSelector), and their settings in the config.

speculators' dflash2 always scores the verifier's whole vocabulary with the verifier's own LM head, reloaded from the
verifier whenever it loads: the export writes the target's head under `lm_head.weight` (as the engines would take it)
and an import leaves it out (ours is rebuilt from the target). `speculative_tokens` is the tokens a forward drafts:
block_size - 1, or block_size with `sample_from_anchor`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import block_setting, read_block_layout, write_block_layout
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.dflash2 import KIND_NAME, DFlash2Config

ARCHITECTURE = "DFlash2DraftModel"
# The config keys of the convolutions and the selector, with speculators' defaults (DFlash2SpeculatorConfig).
HEAD_SETTINGS = {"sample_from_anchor": False, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                 "selector_top_k": 16}


def head_names(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """The convolutions' and the selector's tensors (the DFlash layout's are `block_names`)."""
    h, k, r = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank
    groups = h // cfg.conv_group_size
    names: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            names |= {f"layers.{i}.{conv}.base_kernel": (2, k, h),
                      f"layers.{i}.{conv}.kernel_projection.weight": (2 * k * groups, h)}
    return names | {"candidate_selector.predecessor_codebook": (cfg.vocab_size, r),
                    "candidate_selector.successor_codebook": (cfg.vocab_size, r),
                    "candidate_selector.hidden_projection.weight": (r, h)}


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(DFlash2Config, ckpt.config)
    # a copy: a target with tied embeddings hands out its embedding, which the layout also carries
    state = {**ckpt.state, "lm_head.weight": ctx.target_lm_head().clone()}
    # Bidirectional inside the block on sliding-window layers too (speculators' dflash2 default; every slot of our
    # block sees the whole block).
    extra = {**{key: getattr(cfg, key) for key in HEAD_SETTINGS}, "sliding_window_non_causal": True}
    return write_block_layout(cfg, state, folder, ctx, architecture=ARCHITECTURE, setting=block_setting(cfg),
                              extra_names=head_names(cfg), extra_config=extra)


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    vocab = ((meta.get("transformer_layer_config") or {}).get("vocab_size"))
    if meta.get("draft_vocab_size", vocab) != vocab:
        raise ValueError(f"{folder} (speculators dflash2) scores {meta['draft_vocab_size']} tokens of a {vocab}-token "
                         "vocabulary; dflash2 scores the whole vocabulary (set draft_vocab_size to the verifier's)")
    return read_block_layout(folder, meta, state, num_target_layers, DFlash2Config, target_lm_head=True,
                             **{key: meta.get(key, default) for key, default in HEAD_SETTINGS.items()})


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (dflash2)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators dflash2", 'config.json "speculators_model_type": "dflash2"', _detect,
                           read_speculators))

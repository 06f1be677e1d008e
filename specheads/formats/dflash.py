"""DFlash drafters in speculators' `dflash` layout (what vLLM serves). Our tensors carry speculators' names
(speculators/models/dflash/core.py, DFlashDraftModel.__init__, and model_definitions.py, Qwen3DFlashDecoderLayer);
the export adds the vocabulary mappings, the target's token embedding (as the eagle3 export does) and the config:
`block_size`, `aux_hidden_state_layer_ids`, `mask_token_id`, and `speculative_tokens` = block_size - 1 (the anchor
is the bonus token, `sample_from_anchor: false`); an export asking for fewer (`--speculative-tokens`) records
those, more is refused. SGLang has no DFlash loader."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import (
    ExportContext,
    Exporter,
    Importer,
    check_export,
    foreign_target,
    layer_config,
    layer_config_dict,
    layer_shapes,
    register_exporter,
    register_importer,
    write_folder,
)
from specheads.formats.speculators import (
    FOREIGN_ONLY,
    SPECULATORS_VERSION,
    block_speculative_tokens,
    draft_vocabulary_from_state,
    speculators_block,
    vocab_mappings,
)
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.dflash import KIND_NAME, DFlashConfig
from specheads.heads.fused_head import LAYER_FIELDS

ARCHITECTURE = "DFlashSpeculator"


def speculators_names(cfg: DFlashConfig, lc: Any) -> dict[str, tuple[int, ...]]:
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    names = {"fc.weight": (h, n * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
             "lm_head.weight": (cfg.draft_vocab_size, h), "embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        names |= layer_shapes(f"layers.{i}.", lc, input_width=h, qk_norm=True)
    if cfg.draft_vocab is not None:
        names |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    return names


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(DFlashConfig, ckpt.config)
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    state = {**ckpt.state, **vocab_mappings(cfg), "embed_tokens.weight": ctx.target_embedding()}
    drafted = block_speculative_tokens(ctx, cfg.block_size - 1, KIND_NAME, "block_size - 1, the anchor aside")
    check_export(state, speculators_names(cfg, lc), "speculators dflash (vLLM)")
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": KIND_NAME,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_block(KIND_NAME, drafted, ctx),
        # The bias DFlashAttention builds, named even where the target's config names none (Qwen2's): speculators'
        # Qwen3DFlashDecoderLayer reads it whatever the layer type.
        "transformer_layer_config": {**layer_config_dict(ctx.target_config, cfg.num_layers, cfg.layer),
                                     "attention_bias": bool(getattr(lc, "attention_bias", False))},
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
    }
    return write_folder(folder, config, state)


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    layout = "speculators dflash"
    lc = meta.get("transformer_layer_config") or {}
    if meta.get("sample_from_anchor"):
        raise ValueError(f"{folder} ({layout}) drafts from its anchor (sample_from_anchor: true), which this "
                         "drafter does not; use a dflash drafter trained with the anchor as the bonus token")
    if meta.get("target_hidden_size") not in (None, lc.get("hidden_size")):
        raise ValueError(f"{folder} ({layout}): a draft hidden size ({lc.get('hidden_size')}) other than the target's "
                         f"({meta['target_hidden_size']}) is not supported")
    for key in ("mask_token_id", "aux_hidden_state_layer_ids"):
        if meta.get(key) is None:
            raise ValueError(f"{folder} ({layout}) names no {key}; set the one it was trained with in its config.json")
    if num_target_layers is not None:
        missing = [k for k in meta["aux_hidden_state_layer_ids"] if not 0 < int(k) < num_target_layers]
        if missing:
            raise ValueError(f"{folder} ({layout}) reads target layers {missing}, which a {num_target_layers}-layer "
                             f"target does not have (hidden_states 1..{num_target_layers - 1}); it was trained for "
                             "another target")
    for name in FOREIGN_ONLY:
        state.pop(name, None)
    vocab_size = int(lc["vocab_size"])
    if "lm_head.weight" not in state:
        raise ValueError(f"{folder} ({layout}) has no lm_head.weight (a full-vocabulary drafter reusing its verifier's "
                         "head); export it with its own LM head")
    try:
        cfg = DFlashConfig(hidden_size=int(lc["hidden_size"]), vocab_size=vocab_size,
                           aux_layers=tuple(meta["aux_hidden_state_layer_ids"]),
                           num_layers=int(lc.get("num_hidden_layers", 1)), block_size=int(meta.get("block_size", 8)),
                           mask_token_id=int(meta["mask_token_id"]),
                           draft_vocab=draft_vocabulary_from_state(state, vocab_size),
                           layer={k: lc[k] for k in LAYER_FIELDS if k in lc})
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder} ({layout}): {err}") from None
    verifier = ((meta.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "unknown"
    target = foreign_target(verifier, lc["hidden_size"], vocab_size, lc.get("model_type"))
    return Checkpoint(folder, KIND_NAME, asdict(cfg), target, state, {"imported_from": layout})


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (dflash)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators dflash", 'config.json "speculators_model_type": "dflash"', _detect,
                           read_speculators))

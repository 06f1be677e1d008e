"""EAGLE-1 heads in the layout of EAGLE's own code, which SGLang serves as `LlamaForCausalLMEagle`.

That layout is fc (2H -> H, with bias) over cat(embedding, feature), then decoder layers whose first one
reads fc's output without an input norm (`first_layer_norm: false` here), and the target's own LM head.
Our heads export to it when they were trained that way and read the last layer only (no aux layers).
Original EAGLE-1 checkpoints (a Llama config and fc/layers tensors, often a pickled .bin) import the same way.
"""

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
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.eagle import KIND_NAME, EagleConfig

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
_FOREIGN_ONLY = ("embed_tokens.weight", "lm_head.weight")  # the target's own: shared, not the head's


def sglang_names(cfg: EagleConfig, lc: Any) -> dict[str, tuple[int, ...]]:
    """Tensors SGLang's LlamaForCausalLMEagle loads (python/sglang/srt/models/llama_eagle.py: LlamaModel.__init__,
    whose layer 0 deletes input_layernorm; load_weights skips lm_head and takes embed_tokens from the target)."""
    h = cfg.hidden_size
    names = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
    for i in range(cfg.num_layers):
        names |= layer_shapes(f"layers.{i}.", lc, input_width=h, input_norm=i > 0)
    return names


def write_sglang(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(EagleConfig, ckpt.config)
    if cfg.aux_layers or cfg.first_layer_norm:
        why = "it fuses aux layers" if cfg.aux_layers else "its first layer normalises its input"
        raise ValueError(f"SGLang's {SGLANG_ARCHITECTURE} (EAGLE-1) cannot express these eagle heads ({why}); train "
                         "them with heads.aux_layers=[] heads.first_layer_norm=false, or train EAGLE-3 heads, which "
                         "export to SGLang and vLLM")
    lc = layer_config(ctx.target_config, cfg.num_layers, {})
    check_export(ckpt.state, sglang_names(cfg, lc), f"SGLang {SGLANG_ARCHITECTURE}")
    config = layer_config_dict(ctx.target_config, cfg.num_layers, {})
    # SGLang drafts over the whole vocabulary; the draft vocabulary is kept for reading the export back here.
    config |= {"architectures": [SGLANG_ARCHITECTURE], "model_type": "llama", "tie_word_embeddings": False,
               "specheads_draft_vocab": cfg.draft_vocab}
    return write_folder(folder, config, ckpt.state)


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    if SGLANG_ARCHITECTURE in (meta.get("architectures") or []):
        return True  # EAGLE's own checkpoints: fc with a bias, a first layer without input norm
    return {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= names and \
        "layers.0.input_layernorm.weight" not in names


def read_eagle1(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                num_target_layers: int | None) -> Checkpoint:
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for name in _FOREIGN_ONLY:
        state.pop(name, None)
    try:
        cfg = EagleConfig(hidden_size=int(meta["hidden_size"]), vocab_size=int(meta["vocab_size"]),
                          num_layers=int(meta.get("num_hidden_layers", 1)), first_layer_norm=False,
                          draft_vocab=meta.get("specheads_draft_vocab"))
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder} (EAGLE-1): {err}") from None
    target = foreign_target(meta.get("_name_or_path"), cfg.hidden_size, cfg.vocab_size, meta.get("model_type"))
    return Checkpoint(folder, KIND_NAME, asdict(cfg), target, state, {"imported_from": "EAGLE-1"})


register_exporter(Exporter("sglang", KIND_NAME, f"SGLang ({SGLANG_ARCHITECTURE}, EAGLE-1)", write_sglang,
                           serve="python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE "
                                 "--speculative-draft-model-path DIR --speculative-num-steps 5 "
                                 "--speculative-eagle-topk 4 --speculative-num-draft-tokens 12"))
register_importer(Importer("EAGLE-1", f'config.json "architectures": ["{SGLANG_ARCHITECTURE}"], or fc.bias and a '
                                      "first layer without input_layernorm (EAGLE's own checkpoints)",
                           _detect, read_eagle1))

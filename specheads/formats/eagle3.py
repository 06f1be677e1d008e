"""EAGLE-3 heads in other engines' formats: speculators (what vLLM serves), SGLang/SpecForge, and llama.cpp's GGUF
(`specheads.formats.gguf`).

Our `eagle3` tensors already carry speculators' names (`specheads.heads.eagle3`), so the speculators export
(`specheads.formats.speculators`, the layout P-EAGLE's extends) only adds the vocabulary mappings and the config;
SGLang's `LlamaForCausalLMEagle3` names the first layer `midlayer` and later ones `additional_layers.{i-1}` (whose
pre-attention norm is `hidden_norm`), and counts explicit aux layer ids one lower. The speculators export carries
the target's token embedding (speculators would otherwise have to fetch it from the verifier); SGLang shares the
target's, so its export leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats import gguf
from specheads.formats.base import (
    ExportContext,
    Exporter,
    Importer,
    check_export,
    layer_config,
    layer_config_dict,
    register_exporter,
    register_importer,
    write_folder,
)
from specheads.formats.speculators import (
    chain_names,
    imported_chain,
    read_speculators_layout,
    vocab_mappings,
    write_speculators_layout,
)
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.eagle3 import KIND_NAME, Eagle3Config

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _config(ckpt: Checkpoint) -> Eagle3Config:
    return build(Eagle3Config, ckpt.config)


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    return write_speculators_layout(_config(ckpt), ckpt.state, folder, ctx, architecture="Eagle3Speculator")


def _speculators_detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    return read_speculators_layout(folder, meta, state, num_target_layers, Eagle3Config)


# -- SGLang / SpecForge -------------------------------------------------------------------------------------

def _to_sglang(name: str) -> str:
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        rest = "hidden_norm.weight" if rest == "input_layernorm.weight" else rest
        return f"additional_layers.{int(i) - 1}.{rest}"
    return name


def _from_sglang(name: str) -> str:
    if name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    if name.startswith("additional_layers."):
        i, rest = name[len("additional_layers."):].split(".", 1)
        rest = "input_layernorm.weight" if rest == "hidden_norm.weight" else rest
        return f"layers.{int(i) + 1}.{rest}"
    return name


def sglang_names(cfg: Eagle3Config, lc: Any) -> dict[str, tuple[int, ...]]:
    """Tensors SGLang's LlamaForCausalLMEagle3 loads (python/sglang/srt/models/llama_eagle3.py: LlamaModel.__init__,
    LlamaForCausalLMEagle3.load_weights, which drops unknown names silently and reads d2t, skipping t2d)."""
    # SGLang builds Llama layers whatever the layer type: a Qwen3 layer's q/k norms are no names of it
    names = {_to_sglang(k): v for k, v in chain_names(cfg, lc).items() if not k.endswith(("q_norm.weight",
                                                                                           "k_norm.weight"))}
    del names["embed_tokens.weight"]  # SGLang's EAGLE-3 worker shares the target's embedding
    return names


def write_sglang(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = _config(ckpt)
    unsupported = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if getattr(cfg, k)]
    if unsupported or len(cfg.aux_layers) != 3:
        why = f"{', '.join(unsupported)} set" if unsupported else f"{len(cfg.aux_layers)} aux layers (it reads 3)"
        raise ValueError(f"SGLang's {SGLANG_ARCHITECTURE} cannot express these eagle3 heads ({why}); "
                         "export them with --to speculators for vLLM")
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    state = {_to_sglang(k): v for k, v in {**ckpt.state, **vocab_mappings(cfg)}.items()}
    check_export(state, sglang_names(cfg, lc), f"SGLang {SGLANG_ARCHITECTURE}")
    config = layer_config_dict(ctx.target_config, cfg.num_layers, cfg.layer)
    config |= {"architectures": [SGLANG_ARCHITECTURE], "model_type": "llama", "draft_vocab_size": cfg.draft_vocab_size,
               "tie_word_embeddings": False,
               # SGLang captures hidden_states[k + 1] for an explicit id k (its default ids agree with ours)
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in cfg.aux_layers],
                                "use_aux_hidden_state": True}}
    return write_folder(folder, config, state)


def _sglang_detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return SGLANG_ARCHITECTURE in (meta.get("architectures") or [])


def read_sglang(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                num_target_layers: int | None) -> Checkpoint:
    state = {_from_sglang(k): v for k, v in state.items()}
    ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux = None if ids is None else [k + 1 for k in ids]
    return imported_chain(folder, f"SGLang {SGLANG_ARCHITECTURE}", meta, state, aux, num_target_layers,
                          str(meta.get("_name_or_path") or "unknown"), Eagle3Config)


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (eagle3)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_exporter(Exporter("sglang", KIND_NAME, f"SGLang ({SGLANG_ARCHITECTURE})", write_sglang,
                           serve="python -m sglang.launch_server --model-path {verifier} "
                                 "--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR "
                                 "--speculative-num-steps 5 --speculative-eagle-topk 4 "
                                 "--speculative-num-draft-tokens 12"))
register_importer(Importer("speculators eagle3", 'config.json "speculators_model_type": "eagle3"',
                           _speculators_detect, read_speculators))
register_importer(Importer(f"SGLang {SGLANG_ARCHITECTURE}", f'config.json "architectures": ["{SGLANG_ARCHITECTURE}"]',
                           _sglang_detect, read_sglang))


# -- llama.cpp ------------------------------------------------------------------------------------------------

def write_gguf(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    return gguf.write_chain_gguf(_config(ckpt), ckpt.state, folder, ctx, kind=KIND_NAME, target=ckpt.target,
                                 heads=ckpt.path)


register_exporter(gguf.exporter(KIND_NAME, write_gguf))

"""EAGLE-3 heads in other engines' formats: speculators (what vLLM serves) and SGLang/SpecForge.

Our `eagle3` tensors already carry speculators' names (`specheads.heads.eagle3`), so the speculators export
only adds the vocabulary mappings and the config; SGLang's `LlamaForCausalLMEagle3` names the first layer
`midlayer` and later ones `additional_layers.{i-1}` (whose pre-attention norm is `hidden_norm`), and counts
explicit aux layer ids one lower. The speculators export carries the target's token embedding (speculators
would otherwise have to fetch it from the verifier); SGLang shares the target's, so its export leaves it out.
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
from specheads.heads.eagle3 import (
    KIND_NAME,
    Eagle3Config,
    default_aux_layers,
    draft_vocab_from_d2t,
    eagle3_mappings,
)
from specheads.heads.fused_head import LAYER_FIELDS

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 format this writes
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
_FOREIGN_ONLY = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # never ours to load


def _config(ckpt: Checkpoint) -> Eagle3Config:
    return build(Eagle3Config, ckpt.config)


def _mappings(cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    if cfg.draft_vocab is None:
        return {}
    d2t, t2d = eagle3_mappings(cfg.draft_vocab, cfg.vocab_size)
    return {"d2t": d2t, "t2d": t2d}


# -- speculators (vLLM) -------------------------------------------------------------------------------------

def speculators_names(cfg: Eagle3Config, lc: Any) -> dict[str, tuple[int, ...]]:
    """Tensors speculators' Eagle3DraftModel loads (speculators/models/eagle3/core.py, Eagle3DraftModel.__init__,
    and speculators/model.py DraftVocabMixin._init_vocab). embed_tokens.weight is the target's: speculators
    means to take it from the verifier when absent, but with transformers 5 its loader initialises the missing
    tensor instead, so the export carries it; vLLM reads the same names (vllm/model_executor/models/llama_eagle3.py, load_weights)."""
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    names: dict[str, tuple[int, ...]] = {"fc.weight": (h, n * h), "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
                                         "embed_tokens.weight": (cfg.vocab_size, h)}
    if cfg.norm_before_fc:
        names["input_norm.weight"] = (n * h,)
    if cfg.fc_norm:
        names |= {f"fc_norm.{i}.weight": (h,) for i in range(n)}
    for i in range(cfg.num_layers):
        names |= layer_shapes(f"layers.{i}.", lc, input_width=2 * h if i == 0 else h)
        if i == 0:
            names["layers.0.hidden_norm.weight"] = (h,)
    if cfg.draft_vocab is not None:
        names |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    return names


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    return write_speculators_layout(_config(ckpt), ckpt.state, folder, ctx)


def write_speculators_layout(cfg: Eagle3Config, state: Mapping[str, torch.Tensor], folder: Path, ctx: ExportContext, *,
                             architecture: str = "Eagle3Speculator", speculative_tokens: int | None = None,
                             extra_names: Mapping[str, tuple[int, ...]] | None = None,
                             extra_config: Mapping[str, Any] | None = None) -> list[str]:
    """An eagle3-shaped head (`cfg.KIND`: eagle3 or a kind extending it) in speculators' layout: its tensors, the
    vocabulary mappings and the target's embedding, checked by name and shape, and the config speculators reads."""
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    state = {**state, **_mappings(cfg), "embed_tokens.weight": ctx.target_embedding()}
    check_export(state, {**speculators_names(cfg, lc), **(extra_names or {})}, f"speculators {cfg.KIND} (vLLM)")
    config = {
        "architectures": [architecture],
        "speculators_model_type": cfg.KIND,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": cfg.KIND,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens or ctx.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": ctx.verifier,
                         "architectures": list(getattr(ctx.target_config, "architectures", None) or [])},
        },
        "transformer_layer_config": layer_config_dict(ctx.target_config, cfg.num_layers, cfg.layer),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        **(extra_config or {}),
    }
    return write_folder(folder, config, state)


def draft_vocabulary_from_state(state: dict[str, torch.Tensor], vocab_size: int) -> tuple[int, ...] | None:
    """Pop d2t/t2d; the draft vocabulary they describe, with the LM head's rows sorted by target id to match."""
    state.pop("t2d", None)
    d2t = state.pop("d2t", None)
    if d2t is None:
        if state["lm_head.weight"].shape[0] != vocab_size:
            raise ValueError(f"its LM head scores {state['lm_head.weight'].shape[0]} tokens of a {vocab_size}-token "
                             "vocabulary but it has no d2t mapping; re-export it with d2t")
        return None
    ids = draft_vocab_from_d2t(d2t)
    if ids.numel() > vocab_size:
        raise ValueError(f"its draft vocabulary ({ids.numel()} tokens) is larger than the target vocabulary ({vocab_size})")
    order = ids.argsort()
    state["lm_head.weight"] = state["lm_head.weight"][order]
    return tuple(ids[order].tolist())


def _imported(folder: Path, layout: str, lc: Mapping[str, Any], state: dict[str, torch.Tensor], aux: list[int] | None,
              num_target_layers: int | None, verifier: str, config_cls: type[Eagle3Config] = Eagle3Config,
              **flags: Any) -> Checkpoint:
    for name in _FOREIGN_ONLY:
        state.pop(name, None)
    if aux is None:
        if num_target_layers is None:
            raise ValueError(f"{folder} ({layout}) names no aux layer ids and no target is known to take the default from")
        aux = list(default_aux_layers(num_target_layers))
    try:
        vocab = draft_vocabulary_from_state(state, int(lc["vocab_size"]))
        cfg = config_cls(hidden_size=int(lc["hidden_size"]), vocab_size=int(lc["vocab_size"]), aux_layers=tuple(aux),
                           num_layers=int(lc.get("num_hidden_layers", 1)), draft_vocab=vocab,
                           layer={k: lc[k] for k in LAYER_FIELDS if k in lc}, **flags)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder} ({layout}): {err}") from None
    config = asdict(cfg)
    target = foreign_target(verifier, lc["hidden_size"], lc["vocab_size"], lc.get("model_type"))
    return Checkpoint(folder, cfg.KIND, config, target, state, {"imported_from": layout})


def _speculators_detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    return read_speculators_layout(folder, meta, state, num_target_layers)


def read_speculators_layout(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                            num_target_layers: int | None, config_cls: type[Eagle3Config] = Eagle3Config,
                            **fields: Any) -> Checkpoint:
    """A speculators export of an eagle3-shaped head (`config_cls`, given its own `fields`) as our checkpoint."""
    lc = meta.get("transformer_layer_config") or {}
    if meta.get("target_hidden_size") not in (None, lc.get("hidden_size")):
        raise ValueError(f"{folder}: a draft hidden size ({lc.get('hidden_size')}) other than the target's "
                         f"({meta['target_hidden_size']}) is not supported")
    verifier = ((meta.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "unknown"
    flags = {k: bool(meta.get(k, False)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    return _imported(folder, f"speculators {config_cls.KIND}", lc, state, meta.get("eagle_aux_hidden_state_layer_ids"),
                     num_target_layers, verifier, config_cls, **flags, **fields)


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
    names = {_to_sglang(k): v for k, v in speculators_names(cfg, lc).items()}
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
    state = {_to_sglang(k): v for k, v in {**ckpt.state, **_mappings(cfg)}.items()}
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
    return _imported(folder, f"SGLang {SGLANG_ARCHITECTURE}", meta, state, aux, num_target_layers,
                     str(meta.get("_name_or_path") or "unknown"))


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (eagle3)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_exporter(Exporter("sglang", KIND_NAME, f"SGLang ({SGLANG_ARCHITECTURE})", write_sglang,
                           serve="python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                                 "--speculative-draft-model-path DIR --speculative-num-steps 5 --speculative-eagle-topk 4 "
                                 "--speculative-num-draft-tokens 12"))
register_importer(Importer("speculators eagle3", 'config.json "speculators_model_type": "eagle3"',
                           _speculators_detect, read_speculators))
register_importer(Importer(f"SGLang {SGLANG_ARCHITECTURE}", f'config.json "architectures": ["{SGLANG_ARCHITECTURE}"]',
                           _sglang_detect, read_sglang))

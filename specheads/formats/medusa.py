"""Medusa heads in vLLM's Medusa layout (`--to vllm-medusa`), and that layout read back.

vLLM's `Medusa` model: `blocks.{i}.layers.{j}` are the residual blocks x + silu(linear(x)) (ours:
`blocks.{i}.{j}.linear`), `lm_heads.{i}` the LM heads over `truncated_vocab_size` rows with `token_map`
holding their token ids. Shared heads (the target's own LM head) are written once as `lm_heads.0` with
`original_lm_head: true`. The static tree our heads draft is kept as `specheads_tree` (vLLM ignores it).
"""

from __future__ import annotations

import re
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
    register_exporter,
    register_importer,
    write_folder,
)
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.medusa import KIND_NAME, MedusaConfig

VLLM_ARCHITECTURE = "MedusaModel"
_OURS = re.compile(r"^blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)$")
_VLLM = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")


def vllm_names(cfg: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Tensors vLLM's Medusa model loads (vllm/model_executor/models/medusa.py: Medusa.__init__, ResidualBlock,
    load_weights; `medusa_fc_bias` true since our blocks have biases)."""
    h, v = cfg.hidden_size, cfg.scored_vocab_size
    names: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            names |= {f"blocks.{i}.layers.{j}.weight": (h, h), f"blocks.{i}.layers.{j}.bias": (h,)}
    for i in range(cfg.num_heads if cfg.own_lm_head else 1):
        names[f"lm_heads.{i}.weight"] = (v, h)
    if cfg.draft_vocab is not None:
        names["token_map"] = (v,)
    return names


def write_vllm(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(MedusaConfig, ckpt.config)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.state.items():
        m = _OURS.match(name)
        if m:
            state[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = tensor
        elif name.startswith("lm_heads.") and name.endswith(".bias"):
            raise ValueError("vLLM's Medusa LM heads have no bias; these heads' own LM heads do")
        else:
            state[name] = tensor
    if not cfg.own_lm_head:  # vLLM needs the weights of the shared head: the target's rows of the draft vocabulary
        rows = ctx.target_lm_head()
        state["lm_heads.0.weight"] = rows if cfg.draft_vocab is None else rows[list(cfg.draft_vocab)]
    if cfg.draft_vocab is not None:
        state["token_map"] = torch.tensor(cfg.draft_vocab, dtype=torch.long)
    check_export(state, vllm_names(cfg), "vLLM Medusa")
    config = {"architectures": [VLLM_ARCHITECTURE], "model_type": "medusa", "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "truncated_vocab_size": cfg.scored_vocab_size, "medusa_fc_bias": True,
              "original_lm_head": not cfg.own_lm_head, "specheads_tree": cfg.tree}
    return write_folder(folder, config, state)


def _vllm_detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return VLLM_ARCHITECTURE in (meta.get("architectures") or []) or meta.get("model_type") == "medusa"


def read_vllm(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
              num_target_layers: int | None) -> Checkpoint:
    shared = bool(meta.get("original_lm_head", False))
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _VLLM.match(name.removeprefix("medusa_heads."))
        if m:
            ours[f"blocks.{m[1]}.{m[2]}.linear.{m[3]}"] = tensor
        elif name.startswith("lm_heads.") and not shared:
            ours[name] = tensor
    token_map = state.get("token_map")
    try:
        cfg = MedusaConfig(hidden_size=int(meta["hidden_size"]), vocab_size=int(meta["vocab_size"]),
                           num_heads=int(meta["num_heads"]), num_layers=int(meta.get("num_hidden_layers", 1)),
                           own_lm_head=not shared, draft_vocab=None if token_map is None else tuple(token_map.tolist()),
                           tree=meta.get("specheads_tree"))
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder} (vLLM Medusa): {err}") from None
    target = foreign_target(meta.get("_name_or_path"), cfg.hidden_size, cfg.vocab_size)
    return Checkpoint(folder, KIND_NAME, asdict(cfg), target, ours, {"imported_from": "vLLM Medusa"})


_FD_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_HEAD = re.compile(r"^(\d+)\.(\d+)\.(weight|bias)$")


def _faster_decoding_detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return "medusa_num_heads" in meta


def read_faster_decoding(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                         num_target_layers: int | None) -> Checkpoint:
    """FasterDecoding's Medusa-1 heads (medusa_lm_head.pt/.safetensors): head i is nn.Sequential of
    `medusa_num_layers` ResBlocks (`{i}.{j}.linear`) and its own LM head (`{i}.{num_layers}`)."""
    num_heads, num_layers = int(meta["medusa_num_heads"]), int(meta.get("medusa_num_layers", 1))
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        name = name.removeprefix("medusa_head.")
        block, head = _FD_BLOCK.match(name), _FD_HEAD.match(name)
        if block:
            ours[f"blocks.{block[1]}.{block[2]}.linear.{block[3]}"] = tensor
        elif head and int(head[2]) == num_layers:
            ours[f"lm_heads.{head[1]}.{head[3]}"] = tensor
        else:
            ours[name] = tensor  # left for the strict loader to name
    lm = ours.get("lm_heads.0.weight")
    if lm is None:
        raise ValueError(f"{folder} (FasterDecoding Medusa) has no LM head weights '0.{num_layers}.weight'; "
                         "re-download it")
    cfg = MedusaConfig(hidden_size=int(lm.shape[1]), vocab_size=int(lm.shape[0]), num_heads=num_heads,
                       num_layers=num_layers, own_lm_head=True)
    target = foreign_target(meta.get("base_model_name_or_path"), cfg.hidden_size, cfg.vocab_size)
    return Checkpoint(folder, KIND_NAME, asdict(cfg), target, ours, {"imported_from": "FasterDecoding Medusa"})


register_exporter(Exporter("vllm-medusa", KIND_NAME, f"vLLM ({VLLM_ARCHITECTURE})", write_vllm,
                           serve="vllm serve {verifier} --speculative-config '{{\"method\": \"medusa\", "
                                 "\"model\": \"DIR\", \"num_speculative_tokens\": 3}}'"))
register_importer(Importer("vLLM Medusa", f'config.json "architectures": ["{VLLM_ARCHITECTURE}"]', _vllm_detect,
                           read_vllm))
register_importer(Importer("FasterDecoding Medusa", 'config.json "medusa_num_heads"', _faster_decoding_detect,
                           read_faster_decoding))

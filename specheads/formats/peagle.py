"""P-EAGLE heads in speculators' `peagle` layout (what vLLM serves): the eagle3 layout plus `mask_hidden` and the
config's `mask_token_id`; the block size is the greedy proposal's `speculative_tokens`, as speculators writes it
(speculators/models/peagle/core.py, PEagleDraftModel.from_training_args). An export asking for fewer tokens
(`--speculative-tokens`) records those, which the serving engine then drafts (and an import reads as the block);
more than the block is refused. SGLang has no P-EAGLE loader.

llama.cpp (`--to gguf`, `specheads.formats.gguf`) takes P-EAGLE heads as the EAGLE-3 draft they contain: their first
draft position is EAGLE-3's first step exactly. llama.cpp has no parallel drafting; it drafts autoregressively,
feeding the draft's own hidden state to deeper steps, which P-EAGLE never trained on (its deeper positions read
`mask_hidden`, left out of the file), so past the first token its drafts are seldom accepted: its README recommends
one draft token (`--spec-draft-n-max 1`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats import gguf
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import (
    block_speculative_tokens,
    read_speculators_layout,
    write_speculators_layout,
)
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.peagle import KIND_NAME, PEagleConfig

ARCHITECTURE = "PEagleSpeculator"


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(PEagleConfig, ckpt.config)
    mask = {"mask_hidden": (1, 1, len(cfg.aux_layers) * cfg.hidden_size)}
    return write_speculators_layout(cfg, ckpt.state, folder, ctx, architecture=ARCHITECTURE,
                                    speculative_tokens=block_speculative_tokens(ctx, cfg.num_depths, KIND_NAME,
                                                                                "num_depths"),
                                    extra_names=mask,
                                    extra_config={"mask_token_id": cfg.mask_token_id})


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    if meta.get("mask_token_id") is None:
        raise ValueError(f"{folder} (speculators peagle) names no mask_token_id; set the id its masked positions were "
                         "trained with in its config.json")
    methods = (meta.get("speculators_config") or {}).get("proposal_methods") or [{}]
    depths = int(methods[0].get("speculative_tokens") or PEagleConfig.num_depths)
    return read_speculators_layout(folder, meta, state, num_target_layers, PEagleConfig,
                                   mask_token_id=int(meta["mask_token_id"]), num_depths=depths)


register_exporter(Exporter("speculators", KIND_NAME, "vLLM and speculators (peagle)", write_speculators,
                           serve="vllm serve DIR   # vLLM reads the verifier, {verifier}, from DIR/config.json"))
register_importer(Importer("speculators peagle", 'config.json "speculators_model_type": "peagle"', _detect,
                           read_speculators))


GGUF_NOTE = ("P-EAGLE heads draft here as the EAGLE-3 draft they contain. llama.cpp drafts autoregressively, and past "
             "the first token the heads see inputs they never trained on (their deeper positions read a learned mask "
             "entry, which this file leaves out), so one draft token is the setting to start from; measure deeper "
             "drafts before using them.")


def write_gguf(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    state = {k: v for k, v in ckpt.state.items() if k != "mask_hidden"}  # read by the parallel positions only
    return gguf.write_chain_gguf(build(PEagleConfig, ckpt.config), state, folder, ctx, kind=KIND_NAME,
                                 target=ckpt.target, note=GGUF_NOTE, draft_max=1, heads=ckpt.path)


register_exporter(gguf.exporter(KIND_NAME, write_gguf))

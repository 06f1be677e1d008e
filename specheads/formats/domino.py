"""Domino drafters in speculators' `dflash` layout with `projector_type: domino` (what speculators' Domino saves and
vLLM's Domino loader reads; `specheads.formats.speculators` writes and reads the block drafter's layout): the DFlash
layout plus the correction under its `DominoHead` names (speculators/models/dflash/domino.py, DominoHead.__init__:
`domino_head.prefix_gru.weight_ih_l0`, `.weight_hh_l0`, `domino_head.embed_proj.0.weight`, `.2.weight`), and the
top-level config keys of its DFlashSpeculatorConfig: `projector_type`, `shift_label` (the anchor's slot drafts the
token after it), `pure_draft_prefix_len`, `emb_dim` and `gru_hidden_dim`.

Domino scores the verifier's whole vocabulary with the verifier's own LM head, which speculators reloads from the
verifier: the export writes the target's head under `lm_head.weight` (as the engines would take it) and an import
leaves it out (ours is rebuilt from the target).

Domino's slots are laid out by `shift_label`, not `sample_from_anchor` (false: speculators shifts the labels once for
the former, and would twice with both). Its engines run a block of `speculative_tokens` + 1 slots, the anchor's first,
so an export records block_size - 1 (the block it was trained on; the last slot drafts for our decoding alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specheads.config import build
from specheads.formats.base import ExportContext, Exporter, Importer, register_exporter, register_importer
from specheads.formats.speculators import (
    block_speculative_tokens,
    read_block_layout,
    speculators_block,
    write_block_layout,
)
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.domino import KIND_NAME, DominoConfig

ARCHITECTURE = "DFlashSpeculator"
# speculators files Domino under its DFlash type (DFlashSpeculatorConfig, `speculators_model_type` spelled as the
# architecture's name lower-cased); spelled out it is our dflash kind's name, which only that kind's files write.
SPECULATORS_TYPE = ARCHITECTURE.removesuffix("Speculator").lower()
# The correction's config keys, with speculators' defaults (DFlashSpeculatorConfig).
HEAD_SETTINGS = {"pure_draft_prefix_len": 1, "emb_dim": 256, "gru_hidden_dim": 1024}
SETTING = "block_size - 1: its engines fill a block of the anchor and speculative_tokens masks"


def head_names(cfg: DominoConfig) -> dict[str, tuple[int, ...]]:
    """The correction's tensors (the DFlash layout's are `block_names`)."""
    h, g, e = cfg.hidden_size, cfg.gru_hidden_dim, cfg.emb_dim
    return {"domino_head.prefix_gru.weight_ih_l0": (3 * g, h), "domino_head.prefix_gru.weight_hh_l0": (3 * g, g),
            "domino_head.embed_proj.0.weight": (e, h + g), "domino_head.embed_proj.2.weight": (cfg.vocab_size, e)}


def write_speculators(ckpt: Checkpoint, folder: Path, ctx: ExportContext) -> list[str]:
    cfg = build(DominoConfig, ckpt.config)
    # a copy: a target with tied embeddings hands out its embedding, which the layout also carries
    state = {**ckpt.state, "lm_head.weight": ctx.target_lm_head().clone()}
    drafted = block_speculative_tokens(ctx, cfg.block_size - 1, cfg.KIND, SETTING)
    extra = {"speculators_model_type": SPECULATORS_TYPE,
             "speculators_config": speculators_block(SPECULATORS_TYPE, drafted, ctx),
             "projector_type": KIND_NAME, "shift_label": True, "sample_from_anchor": False,
             **{key: getattr(cfg, key) for key in HEAD_SETTINGS}}
    return write_block_layout(cfg, state, folder, ctx, architecture=ARCHITECTURE, setting=SETTING,
                              extra_names=head_names(cfg), extra_config=extra)


def _detect(meta: Mapping[str, Any], names: set[str]) -> bool:
    return meta.get("speculators_model_type") == SPECULATORS_TYPE and meta.get("projector_type") == KIND_NAME


def read_speculators(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                     num_target_layers: int | None) -> Checkpoint:
    layout = f"speculators {SPECULATORS_TYPE}, projector_type {KIND_NAME}"
    if meta.get("shift_label") is False or meta.get("sample_from_anchor"):
        raise ValueError(f"{folder} ({layout}) lays its slots out with shift_label {meta.get('shift_label')} and "
                         f"sample_from_anchor {meta.get('sample_from_anchor')}; this drafter reads Domino's own "
                         "layout (shift_label: true, sample_from_anchor: false): re-export it so")
    vocab = (meta.get("transformer_layer_config") or {}).get("vocab_size")
    if meta.get("draft_vocab_size", vocab) != vocab:
        raise ValueError(f"{folder} ({layout}) scores {meta['draft_vocab_size']} tokens of a {vocab}-token "
                         "vocabulary; Domino scores the whole vocabulary (set draft_vocab_size to the verifier's)")
    return read_block_layout(folder, meta, state, num_target_layers, DominoConfig, target_lm_head=True,
                             **{key: meta.get(key, default) for key, default in HEAD_SETTINGS.items()})


register_exporter(Exporter("speculators", KIND_NAME, f"vLLM and speculators ({SPECULATORS_TYPE}, projector_type "
                                                     f"{KIND_NAME})", write_speculators,
                           serve="vllm serve DIR   # a vLLM with Domino support reads the verifier, {verifier}, "
                                 "from DIR/config.json"))
register_importer(Importer(f"speculators {KIND_NAME}",
                           f'config.json "speculators_model_type": "{SPECULATORS_TYPE}", "projector_type": '
                           f'"{KIND_NAME}"', _detect, read_speculators))

"""speculators' layouts (what vLLM serves), as far as several kinds share them: the fused chain head's (eagle3 and
peagle, `specheads.heads.fused_chain`), the block drafter's (dflash, dflash2, dspark and xpress,
`specheads.heads.block_drafter`), the vocabulary mappings and the version every speculators export writes.

A kind's own file registers its exporter and importer (`specheads.formats.eagle3`, `.peagle`, `.dflash`, `.dflash2`,
`.dspark`, `.xpress`) and adds what is its own: the config keys, extra tensors, and how its block is recorded
(`block_speculative_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specheads.formats.base import (
    ExportContext,
    check_export,
    foreign_target,
    layer_config,
    layer_config_dict,
    layer_shapes,
    write_folder,
)
from specheads.heads.block_drafter import BlockDrafterConfig
from specheads.heads.checkpoint import Checkpoint
from specheads.heads.draft_vocab import draft_vocab_from_d2t, speculators_mappings
from specheads.heads.fused_chain import FusedChainConfig
from specheads.heads.fused_head import LAYER_FIELDS, default_aux_layers

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose formats this writes
FOREIGN_ONLY = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # never ours to load
DEFAULT_SPECULATIVE_TOKENS = 3  # a chain drafter's draft depth where the export names none


def block_speculative_tokens(ctx: ExportContext, block: int, kind: str, setting: str) -> int:
    """The greedy proposal's `speculative_tokens` of a drafter filling `block` tokens per forward: the block itself
    unless the export asks for fewer (the serving engine drafts that many of them); a deeper draft than the drafter
    was trained to fill is refused, naming the fix."""
    wanted = ctx.speculative_tokens
    if wanted is None:
        return block
    if not 1 <= wanted <= block:
        raise ValueError(f"--speculative-tokens {wanted}: these {kind} heads draft {block} tokens per forward "
                         f"({setting}); pass --speculative-tokens {block} or less (>= 1), or leave it out to record "
                         f"{block}")
    return wanted


def speculators_block(kind: str, speculative_tokens: int, ctx: ExportContext) -> dict[str, Any]:
    """The `speculators_config` every speculators export writes: a greedy proposal of `speculative_tokens` and the
    verifier as the engines load it (its name and its own model classes)."""
    return {
        "algorithm": kind,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": ctx.verifier, "architectures": list(ctx.verifier_architectures)},
    }


def vocab_mappings(cfg: Any) -> dict[str, torch.Tensor]:
    """speculators' d2t/t2d of a head config's draft vocabulary (none for a full-vocabulary head)."""
    if cfg.draft_vocab is None:
        return {}
    d2t, t2d = speculators_mappings(cfg.draft_vocab, cfg.vocab_size)
    return {"d2t": d2t, "t2d": t2d}


def chain_names(cfg: FusedChainConfig, lc: Any) -> dict[str, tuple[int, ...]]:
    """Tensors speculators' Eagle3DraftModel loads (speculators/models/eagle3/core.py, Eagle3DraftModel.__init__,
    and speculators/model.py DraftVocabMixin._init_vocab). embed_tokens.weight is the target's: speculators
    means to take it from the verifier when absent, but with transformers 5 its loader initialises the missing
    tensor instead, so the export carries it; vLLM reads the same names (vllm/model_executor/models/llama_eagle3.py,
    load_weights). Qwen3 layers (speculators' `qwen3` layer type) carry their per-head q/k norms."""
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    names: dict[str, tuple[int, ...]] = {"fc.weight": (h, n * h), "norm.weight": (h,),
                                         "lm_head.weight": (cfg.draft_vocab_size, h),
                                         "embed_tokens.weight": (cfg.vocab_size, h)}
    if cfg.norm_before_fc:
        names["input_norm.weight"] = (n * h,)
    if cfg.fc_norm:
        names |= {f"fc_norm.{i}.weight": (h,) for i in range(n)}
    for i in range(cfg.num_layers):
        names |= layer_shapes(f"layers.{i}.", lc, input_width=2 * h if i == 0 else h,
                              qk_norm=lc.model_type == "qwen3")
        if i == 0:
            names["layers.0.hidden_norm.weight"] = (h,)
    if cfg.draft_vocab is not None:
        names |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    return names


def write_speculators_layout(cfg: FusedChainConfig, state: Mapping[str, torch.Tensor], folder: Path,
                             ctx: ExportContext, *, architecture: str, speculative_tokens: int | None = None,
                             extra_names: Mapping[str, tuple[int, ...]] | None = None,
                             extra_config: Mapping[str, Any] | None = None,
                             with_embedding: bool = True) -> list[str]:
    """A fused chain head (`cfg.KIND`: eagle3, or a kind extending it) in speculators' layout: its tensors, the
    vocabulary mappings and the target's embedding, checked by name and shape, and the config speculators reads.
    `speculative_tokens` (None: the export's, else 3) is the greedy proposal's draft depth. `with_embedding=False`
    leaves the target's embedding out (for a reader that shares the target's, llama.cpp's converter): the target's
    weights are then never loaded."""
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    expected = {**chain_names(cfg, lc), **(extra_names or {})}
    state = {**state, **vocab_mappings(cfg)}
    if with_embedding:
        state["embed_tokens.weight"] = ctx.target_embedding()
    else:
        del expected["embed_tokens.weight"]
    check_export(state, expected, f"speculators {cfg.KIND} (vLLM)")
    config = {
        "architectures": [architecture],
        "speculators_model_type": cfg.KIND,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_block(
            cfg.KIND, speculative_tokens or ctx.speculative_tokens or DEFAULT_SPECULATIVE_TOKENS, ctx),
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


def draft_vocabulary_from_state(state: dict[str, torch.Tensor], vocab_size: int,
                                draft_rows: tuple[str, ...] = ()) -> tuple[int, ...] | None:
    """Pop d2t/t2d; the draft vocabulary they describe, with the LM head's rows (and those of `draft_rows`, other
    tensors with a row per draft token) sorted by target id to match."""
    state.pop("t2d", None)
    d2t = state.pop("d2t", None)
    if d2t is None:
        if state["lm_head.weight"].shape[0] != vocab_size:
            raise ValueError(f"its LM head scores {state['lm_head.weight'].shape[0]} tokens of a {vocab_size}-token "
                             "vocabulary but it has no d2t mapping; re-export it with d2t")
        return None
    ids = draft_vocab_from_d2t(d2t)
    if ids.numel() > vocab_size:
        raise ValueError(f"its draft vocabulary ({ids.numel()} tokens) is larger than the target vocabulary "
                         f"({vocab_size})")
    order = ids.argsort()
    for name in ("lm_head.weight", *draft_rows):
        state[name] = state[name][order]
    return tuple(ids[order].tolist())


def imported_chain(folder: Path, layout: str, lc: Mapping[str, Any], state: dict[str, torch.Tensor],
                   aux: list[int] | None, num_target_layers: int | None, verifier: str,
                   config_cls: type[FusedChainConfig], **flags: Any) -> Checkpoint:
    """A fused chain head read from another engine's layout (`layout`, its layer config `lc`) as our checkpoint."""
    for name in FOREIGN_ONLY:
        state.pop(name, None)
    if aux is None:
        if num_target_layers is None:
            raise ValueError(f"{folder} ({layout}) names no aux layer ids "
                             "and no target is known to take the default from")
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


def read_speculators_layout(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                            num_target_layers: int | None, config_cls: type[FusedChainConfig],
                            **fields: Any) -> Checkpoint:
    """A speculators export of a fused chain head (`config_cls`, given its own `fields`) as our checkpoint."""
    lc = meta.get("transformer_layer_config") or {}
    if meta.get("target_hidden_size") not in (None, lc.get("hidden_size")):
        raise ValueError(f"{folder}: a draft hidden size ({lc.get('hidden_size')}) other than the target's "
                         f"({meta['target_hidden_size']}) is not supported")
    verifier = ((meta.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "unknown"
    flags = {k: bool(meta.get(k, False)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    return imported_chain(folder, f"speculators {config_cls.KIND}", lc, state,
                          meta.get("eagle_aux_hidden_state_layer_ids"), num_target_layers, verifier, config_cls,
                          **flags, **fields)


def block_names(cfg: BlockDrafterConfig, lc: Any) -> dict[str, tuple[int, ...]]:
    """Tensors speculators' block drafters load (speculators/models/dflash/core.py, DFlashDraftModel.__init__, and
    model_definitions.py, Qwen3DFlashDecoderLayer; vLLM reads the same names), ours under the same names."""
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    names = {"fc.weight": (h, n * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
             "lm_head.weight": (cfg.draft_vocab_size, h), "embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        names |= layer_shapes(f"layers.{i}.", lc, input_width=h, qk_norm=True)
    if cfg.draft_vocab is not None:
        names |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    return names


def block_setting(cfg: BlockDrafterConfig) -> str:
    """How a block kind's export records its speculative tokens per forward (the model card's words)."""
    return "block_size, the anchor's slot included" if cfg.first_slot == 0 else "block_size - 1, the anchor aside"


def refuse_own_full_vocabulary_head(cfg: BlockDrafterConfig, state: Mapping[str, torch.Tensor],
                                    ctx: ExportContext) -> None:
    """speculators (`DFlashDraftModel`, and so every block kind built on it) neither saves nor loads the LM head of a
    drafter that scores the whole vocabulary: it puts its verifier's in place. A full-vocabulary drafter whose head
    was trained would then serve other logits than it trained with, so such an export is refused."""
    if cfg.draft_vocab_size != cfg.vocab_size:  # speculators' own test (`use_draft_vocab`)
        return
    head = state["lm_head.weight"]  # a draft vocabulary of every token lists them in order: the target's rows
    if not torch.equal(head, ctx.target_lm_head().to(head.dtype)):
        raise ValueError(f"this {cfg.KIND} drafter scores the whole vocabulary with an LM head it trained, and "
                         "speculators loads a full-vocabulary block drafter with its verifier's LM head in place of "
                         "its own, so it would serve other logits than it trained with; train it with a draft "
                         f"vocabulary (draft_vocab_size: N below the target's {cfg.vocab_size}: its head is kept)")


def write_block_layout(cfg: BlockDrafterConfig, state: Mapping[str, torch.Tensor], folder: Path, ctx: ExportContext,
                       *, architecture: str, setting: str,
                       extra_names: Mapping[str, tuple[int, ...]] | None = None,
                       extra_config: Mapping[str, Any] | None = None) -> list[str]:
    """A block drafter (`cfg.KIND`) in speculators' layout: its tensors, the vocabulary mappings and the target's
    embedding (as the eagle3 export carries it), checked by name and shape, and the config: `block_size`,
    `aux_hidden_state_layer_ids`, `mask_token_id`, `sample_from_anchor` (whether the anchor's slot drafts), and
    `speculative_tokens` = the tokens a forward drafts (`setting` says which, for the refusal of more)."""
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    refuse_own_full_vocabulary_head(cfg, state, ctx)
    state = {**state, **vocab_mappings(cfg), "embed_tokens.weight": ctx.target_embedding()}
    drafted = block_speculative_tokens(ctx, cfg.drafted, cfg.KIND, setting)
    check_export(state, {**block_names(cfg, lc), **(extra_names or {})}, f"speculators {cfg.KIND} (vLLM)")
    config = {
        "architectures": [architecture],
        "speculators_model_type": cfg.KIND,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_block(cfg.KIND, drafted, ctx),
        # The bias our attention builds, named even where the target's config names none (Qwen2's): speculators'
        # Qwen3DFlashDecoderLayer reads it whatever the layer type.
        "transformer_layer_config": {**layer_config_dict(ctx.target_config, cfg.num_layers, cfg.layer),
                                     "attention_bias": bool(getattr(lc, "attention_bias", False))},
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": cfg.first_slot == 0,
        "tie_word_embeddings": False,
        **(extra_config or {}),
    }
    return write_folder(folder, config, state)


def read_block_layout(folder: Path, meta: Mapping[str, Any], state: dict[str, torch.Tensor],
                      num_target_layers: int | None, config_cls: type[BlockDrafterConfig],
                      draft_rows: tuple[str, ...] = (), target_lm_head: bool = False, **fields: Any) -> Checkpoint:
    """A speculators export of a block drafter (`config_cls`, given its own `fields`; `draft_rows` its tensors with a
    row per draft token besides the LM head) as our checkpoint. With `target_lm_head` the kind scores the whole
    vocabulary with the target's own LM head, which the layout may carry but our checkpoint does not."""
    layout = f"speculators {config_cls.KIND}"
    lc = meta.get("transformer_layer_config") or {}
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
    if target_lm_head:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{folder} ({layout}) has no lm_head.weight (a full-vocabulary drafter reusing its verifier's "
                         "head); export it with its own LM head")
    try:
        cfg = config_cls(hidden_size=int(lc["hidden_size"]), vocab_size=vocab_size,
                         aux_layers=tuple(meta["aux_hidden_state_layer_ids"]),
                         num_layers=int(lc.get("num_hidden_layers", 1)), block_size=int(meta.get("block_size", 8)),
                         mask_token_id=int(meta["mask_token_id"]),
                         draft_vocab=None if target_lm_head else draft_vocabulary_from_state(state, vocab_size,
                                                                                             draft_rows),
                         layer={k: lc[k] for k in LAYER_FIELDS if k in lc}, **fields)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder} ({layout}): {err}") from None
    verifier = ((meta.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "unknown"
    target = foreign_target(verifier, lc["hidden_size"], vocab_size, lc.get("model_type"))
    return Checkpoint(folder, cfg.KIND, asdict(cfg), target, state, {"imported_from": layout})

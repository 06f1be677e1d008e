"""The decoder layers a draft head builds for a target: the target's own, or Llama's with the target's sizes.

A head of Llama, Qwen3 and Mistral targets copies the target's decoder layer, norm and rotary embedding classes, so
its layers are the target's own maths at one or two layers' depth. Other families' layers do not fit a head or its
exports: Qwen2's q/k/v biases have no place in the engines' drafter layers, Phi-3 fuses q/k/v, OLMo 2 and
EXAONE 4 put their norms after attention, Gemma's rotary embedding wants a layer type and its norms scale by 1 + w,
gpt-oss has attention sinks and a mixture of experts.
A head for those gets Llama layers of the target's sizes (hidden, heads, kv heads, head dim, MLP width, activation,
rotary base), the layout of vLLM's and SGLang's EAGLE-3 drafter models. Checkpoints and exports say which: the
layer config they write is this module's. Every head reads the target's embedding rows plainly (`embedding_rows`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specheads.features import check_aux_layers
from specheads.hf import LLAMA_LAYOUT_FAMILIES, decoder_of, text_config

# Targets whose heads copy the target's own layer classes: the Llama-layout families whose layers the engines'
# drafter models hold (speculators builds Llama and Qwen3 layers, SGLang Llama layers; a Mistral layer is a Llama
# layer). Qwen2's q/k/v biases have no place in those (a Llama layer's `attention_bias` biases o_proj too), so a
# Qwen2 target's heads get Llama layers, as speculators' own trainer builds for a Qwen2 verifier.
MIRRORED_FAMILIES = tuple(f for f in LLAMA_LAYOUT_FAMILIES if f != "qwen2")


def mirrors_target(text_config: PretrainedConfig) -> bool:
    return text_config.model_type in MIRRORED_FAMILIES


def source_layer_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The config a head's layers are cut from: the target's text config, or a Llama config of its sizes."""
    if mirrors_target(text_config):
        return copy.deepcopy(text_config)
    cfg = text_config
    heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' rotary base
        rope = dict(rope["full_attention"])
    rope.pop("partial_rotary_factor", None)  # the head rotates whole heads
    llama = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or 1e-6,
        hidden_act=getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu",
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )
    llama._attn_implementation = "sdpa"  # Llama layers have it, whatever the target needs (eager for sinks)
    return llama


def draft_layer_config(target: nn.Module, hidden_size: int, aux_layers: Any, num_layers: int, kind: str,
                       overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """The HF config of a draft head's `num_layers` decoder layers (`source_layer_config`, cut to that depth and with
    `overrides` set), after checking the head's hidden size and aux layers fit the target."""
    tcfg = text_config(target)
    if tcfg.hidden_size != hidden_size:
        raise ValueError(f"{kind} hidden_size {hidden_size} != target hidden size {tcfg.hidden_size}")
    check_aux_layers(aux_layers, tcfg.num_hidden_layers)
    return head_layer_config(tcfg, num_layers, overrides or {})


def head_layer_config(text_config: PretrainedConfig, num_layers: int, overrides: dict[str, Any]) -> PretrainedConfig:
    """`source_layer_config`, cut to a head's `num_layers` layers and with the head's own layer settings: what a head
    builds its layers from and what its exports write."""
    layer_cfg = source_layer_config(text_config)
    layer_cfg.num_hidden_layers = num_layers
    if getattr(layer_cfg, "layer_types", None):
        layer_cfg.layer_types = layer_cfg.layer_types[:num_layers]
    for name, value in overrides.items():
        setattr(layer_cfg, name, value)
    return layer_cfg


@dataclass(frozen=True)
class DraftLayerClasses:
    layer: type  # the decoder layer: (config, layer_idx=i)
    norm: type  # RMSNorm: (hidden, eps=)
    rotary: type  # rotary embedding: (config=), called (x, position_ids=)
    mlp: type  # the layer's MLP: (config)
    mirrored: bool  # the target's own classes (their weights and norms follow the target's conventions)


def draft_layer_classes(target: nn.Module) -> DraftLayerClasses:
    if not mirrors_target(target.config.get_text_config()):
        return DraftLayerClasses(LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding, LlamaMLP, mirrored=False)
    decoder = decoder_of(target)
    return DraftLayerClasses(type(decoder.layers[0]), type(decoder.norm), type(decoder.rotary_emb),
                             type(decoder.layers[0].mlp), mirrored=True)


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
    """The target's embedding rows for `ids`, looked up plainly: what speculators and vLLM hand a drafter. Gemma 3's
    embedding module scales its rows by sqrt(H) inside (Gemma 2 and Granite scale outside theirs); a drafter that
    called the module would read other inputs than the same drafter exported."""
    return nn.functional.embedding(ids, embedding.weight)


@torch.no_grad()
def final_norm_scale(target: nn.Module) -> torch.Tensor:  # [H]
    """What the target's final norm multiplies a normalised row by, whatever its convention (w, or 1 + w in Gemma):
    its output for a row of ones, whose RMS is 1 (up to eps)."""
    norm = decoder_of(target).norm
    h = target.config.get_text_config().hidden_size
    weight = next(norm.parameters())
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 0.0)
    return norm(torch.ones(1, h, dtype=weight.dtype, device=weight.device))[0] * (1.0 + eps) ** 0.5

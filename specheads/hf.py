"""Small compatibility helpers for transformers models used by both training and inference."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

# Model types whose decoder layers are Llama's (attention with q/k/v/o projections and optional q/k norms, a gated
# MLP, two RMSNorms, one rotary embedding): the lean forward runs them, and draft heads copy their layers.
LLAMA_LAYOUT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@functools.cache
def _cache_argument(module_class: type) -> str:
    # transformers 5.x renamed `past_key_values` to `cache`; accept either spelling.
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


def cache_kwargs(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """Keyword arguments that hand `cache` to `module.forward` (a model or a decoder layer), with use_cache=True."""
    return {_cache_argument(type(module)): cache, "use_cache": True}


def text_config(model: torch.nn.Module) -> Any:
    return model.config.get_text_config()


def causal_lm_class(config: Any) -> type:
    """The auto class that builds a text generator for `config`: AutoModelForCausalLM, or for image-text checkpoints
    it does not map (Qwen2.5-VL, Mistral 3, LLaVA) AutoModelForImageTextToText, whose forward on token ids alone
    runs the text decoder (the engine sends no images). Anything else is refused by name."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise ValueError(f"a {config.model_type!r} model is neither a causal LM nor an image-text model transformers can "
                     "generate text with; use a decoder-only causal LM (docs/targets.md lists the families checked)")


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (the module holding `layers`, `norm` and `rotary_emb`) of an HF causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__} has no decoder stack with `layers`; use a decoder-only causal LM")
    return decoder

"""EAGLE-1 draft head: predicts the target's next feature from (feature, next token).

At position t the head reads the target's feature F_t (its last hidden state, after
the final norm) and the embedding of token x_{t+1}, and predicts F_{t+1}; the
target's frozen LM head turns that into a distribution over x_{t+2}:

    h = fc(cat(embed(x_{t+1}), F_t)) -> decoder layer(s) of the target's architecture -> F̂_{t+1}

The decoder layers are built from the target's own config and classes, so any HF
decoder-only architecture works. Embeddings and LM head are the target's, frozen
and not saved with the head. With a `draft_vocab` (see `draft_vocab.py`) the head's logits
cover only those tokens; `token_ids` maps logit indices back to token ids.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specheads.heads.checkpoint import TargetInfo, load_heads, save_heads
from specheads.heads.draft_vocab import check_draft_vocab
from specheads.hf import cache_kwargs, decoder_of, text_config

HEAD_TYPE = "eagle"


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    vocab_size: int
    num_layers: int = 1
    init_from_target_layer: int | None = None  # copy this target layer's weights into the head's layer(s)
    draft_vocab: tuple[int, ...] | None = None  # token ids the head scores, sorted; None: the whole vocabulary

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"eagle num_layers must be >= 1, got {self.num_layers}")
        object.__setattr__(self, "draft_vocab", check_draft_vocab(self.draft_vocab, self.vocab_size, HEAD_TYPE))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, target: nn.Module) -> None:
        super().__init__()
        tcfg = text_config(target)
        if tcfg.hidden_size != config.hidden_size:
            raise ValueError(f"eagle hidden_size {config.hidden_size} != target hidden size {tcfg.hidden_size}")
        self.config = config
        decoder = decoder_of(target)
        layer_cfg = copy.deepcopy(tcfg)
        layer_cfg.num_hidden_layers = config.num_layers
        if getattr(layer_cfg, "layer_types", None):
            layer_cfg.layer_types = layer_cfg.layer_types[: config.num_layers]
        layer_cls = type(decoder.layers[0])
        dtype = next(target.parameters()).dtype
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True, dtype=dtype)
        self.layers = nn.ModuleList(layer_cls(layer_cfg, layer_idx=i).to(dtype) for i in range(config.num_layers))
        self.rotary_emb = type(decoder.rotary_emb)(config=layer_cfg)
        self.layer_config = layer_cfg
        # The target's embeddings and LM head: shared, frozen, outside this module's parameters.
        self._frozen = (target.get_input_embeddings(), target.get_output_embeddings())
        ids = None if config.draft_vocab is None else torch.tensor(config.draft_vocab, dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)  # [Vd] or None; rebuilt from the config
        self._init_weights(target)

    def _init_weights(self, target: nn.Module) -> None:
        h = self.config.hidden_size
        with torch.no_grad():
            # Start as "feature passes through": the token embedding half starts small, the feature half as identity.
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.weight[:, :h].normal_(std=0.02)
            self.fc.bias.zero_()
        src = self.config.init_from_target_layer
        if src is not None:
            layers = decoder_of(target).layers
            if not -len(layers) <= src < len(layers):
                raise ValueError(f"init_from_target_layer={src} is out of range for a {len(layers)}-layer target")
            for layer in self.layers:
                layer.load_state_dict(layers[src].state_dict())

    @property
    def embed_tokens(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] tokens x_{t+1}
        features: torch.Tensor,  # [B, T, H] target features F_t
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, 1, T, S] additive; None = causal, no cache prefix
        cache: Any = None,  # an HF Cache holding earlier positions (inference)
    ) -> torch.Tensor:  # [B, T, H] predicted features F̂_{t+1}
        with torch.no_grad():
            emb = self.embed_tokens(input_ids)
        hidden = self.fc(torch.cat([emb.to(features.dtype), features], dim=-1))
        pos = self.rotary_emb(hidden, position_ids=position_ids)
        extra = cache_kwargs(self.layers[0], cache) if cache is not None else {}
        for layer in self.layers:
            out = layer(hidden, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=pos, **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] over the full vocabulary
        return self.lm_head(hidden)

    def draft_weight(self) -> torch.Tensor:  # [Vd, H]: the LM head rows of the draft vocabulary
        weight = self.lm_head.weight
        return weight if self.draft_ids is None else weight[self.draft_ids]

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:  # indices into the draft logits -> token ids
        return index if self.draft_ids is None else self.draft_ids[index]

    def save_pretrained(self, path: str | Path, target: TargetInfo, extra: dict | None = None) -> None:
        save_heads(path, self, head_type=HEAD_TYPE, config={**asdict(self.config), **(extra or {})}, target=target)

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model: nn.Module, target_name: str | None = None) -> EagleHead:
        head_type, config, info, state = load_heads(path)
        if head_type != HEAD_TYPE:
            raise ValueError(f"{path} holds {head_type!r} heads, not eagle heads; use --method {head_type}")
        info.check_compatible(target_model, target_name)
        fields = {k: v for k, v in config.items() if k in EagleConfig.__dataclass_fields__}
        head = cls(EagleConfig(**{**fields, "init_from_target_layer": None}), target_model)
        head.load_state_dict(state, strict=True)
        return head.to(next(target_model.parameters()).device).eval()


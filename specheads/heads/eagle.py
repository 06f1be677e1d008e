"""EAGLE-1 draft head: predicts the target's next feature from (feature, next token).

At position t the head reads the target's feature F_t (its last hidden state, after
the final norm) and the embedding of token x_{t+1}, and predicts F_{t+1}; the
target's frozen LM head turns that into a distribution over x_{t+2}:

    h = fc(cat(embed(x_{t+1}), F_t)) -> decoder layer(s) -> F̂_{t+1}

With `aux_layers` (EAGLE-3's multi-layer features) the head also reads the target's hidden
states after those intermediate layers: `fuse` maps cat(aux..., F_t) back to one feature. It
starts as "pass F_t through" (aux weights zero), so training begins from EAGLE-1 and can only
add what the lower layers know about tokens further ahead. Draft steps after the first read the
head's own predicted feature, which already lives in F's space, so they skip `fuse`.

The decoder layers are the target's own classes for Llama-family targets, else Llama layers of
the target's sizes (`specheads.draft_layers`). Embeddings and LM head are the target's, frozen
and not saved with the head. With a `draft_vocab` (see `draft_vocab.py`) the head's logits
cover only those tokens; `token_ids` maps logit indices back to token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specheads.draft_layers import draft_layer_classes, draft_layer_config, embedding_rows
from specheads.features import feature_rows, feature_width
from specheads.heads.draft_vocab import check_draft_vocab
from specheads.hf import cache_kwargs, decoder_of
from specheads.kinds import DrafterKind, register_kind
from specheads.target_logits import logit_map

KIND_NAME = "eagle"


@dataclass(frozen=True)
class EagleConfig:
    """What an EAGLE head is; saved as its checkpoint's `config`."""

    hidden_size: int  # the target's hidden size H
    vocab_size: int  # rows of the target's LM head
    num_layers: int = 1  # decoder layers in the head (`specheads.draft_layers`)
    init_from_target_layer: int | None = None  # copy this target layer's weights into the head's layer(s)
    draft_vocab: tuple[int, ...] | None = None  # token ids the head scores, sorted; None: the whole vocabulary
    aux_layers: tuple[int, ...] = ()  # target hidden_states indices fused with F_t (EAGLE-3: low, mid, high);
    # () = EAGLE-1
    first_layer_norm: bool = True  # false: the first layer reads fc's output unnormed, as EAGLE-1's own code
    # (and SGLang) do

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"eagle num_layers must be >= 1, got {self.num_layers}")
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        object.__setattr__(self, "draft_vocab", check_draft_vocab(self.draft_vocab, self.vocab_size, KIND_NAME))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, target: nn.Module) -> None:
        super().__init__()
        layer_cfg = draft_layer_config(target, config.hidden_size, config.aux_layers, config.num_layers, KIND_NAME)
        self.config = config
        classes = draft_layer_classes(target)
        layer_cls = classes.layer
        dtype = next(target.parameters()).dtype
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True, dtype=dtype)
        if config.aux_layers:
            self.fuse = nn.Linear(self.feature_width, config.hidden_size, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(layer_cls(layer_cfg, layer_idx=i).to(dtype) for i in range(config.num_layers))
        if not config.first_layer_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = classes.rotary(config=layer_cfg)
        self.layer_config = layer_cfg
        # The target's embeddings and LM head: shared, frozen, outside this module's parameters.
        self._frozen = (target.get_input_embeddings(), target.get_output_embeddings())
        self.logit_map = logit_map(target.config)  # what the target does to that LM head's output
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
            if self.config.aux_layers:  # aux layers start silent: the head begins as EAGLE-1
                self.fuse.weight.zero_()
                self.fuse.weight[:, -h:].copy_(torch.eye(h))
        src = self.config.init_from_target_layer
        if src is not None:
            layers = decoder_of(target).layers
            if not -len(layers) <= src < len(layers):
                raise ValueError(f"init_from_target_layer={src} is out of range for a {len(layers)}-layer target")
            if not draft_layer_classes(target).mirrored:
                raise ValueError(f"init_from_target_layer copies a target layer into the head, but a "
                                 f"{target.config.get_text_config().model_type} head has Llama layers of its own "
                                 "(specheads.draft_layers); leave init_from_target_layer unset")
            for layer in self.layers:
                own = layer.state_dict()
                layer.load_state_dict({k: v for k, v in layers[src].state_dict().items() if k in own})

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]: the target's rows, unscaled
        return embedding_rows(self._frozen[0], ids)

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    @property
    def feature_width(self) -> int:  # D, the width of the target features the head reads
        return feature_width(self.config.hidden_size, self.config.aux_layers)

    def select_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:  # HF hidden_states -> [..., D]
        return feature_rows(hidden_states, self.config.aux_layers)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., D] target features -> [..., H]
        if not self.config.aux_layers:
            return features
        h = self.config.hidden_size
        aux, last = features[..., :-h], features[..., -h:]
        # Intermediate residual streams differ in scale by layer; RMS-normalise each before fusing.
        aux = aux.unflatten(-1, (-1, h))
        aux = aux * torch.rsqrt(aux.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(aux.dtype)
        return self.fuse(torch.cat([aux.flatten(-2), last], dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] tokens x_{t+1}
        features: torch.Tensor,  # [B, T, D] target features (fused here) or [B, T, H] the head's own predictions
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, 1, T, S] additive; None = causal, no cache prefix
        cache: Any = None,  # an HF Cache holding earlier positions (inference)
    ) -> torch.Tensor:  # [B, T, H] predicted features F̂_{t+1}
        with torch.no_grad():
            emb = self.embed_tokens(input_ids)
        if features.shape[-1] != self.config.hidden_size:
            features = self.fuse_features(features)
        hidden = self.fc(torch.cat([emb.to(features.dtype), features], dim=-1))
        pos = self.rotary_emb(hidden, position_ids=position_ids)
        extra = cache_kwargs(self.layers[0], cache) if cache is not None else {}
        for layer in self.layers:
            out = layer(hidden, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=pos,
                        **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def draft_weight(self) -> torch.Tensor:  # [Vd, H]: the LM head rows of the draft vocabulary
        weight = self.lm_head.weight
        return weight if self.draft_ids is None else weight[self.draft_ids]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd], as the target scores
        return self.logit_map(hidden @ self.draft_weight().T)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:  # indices into the draft logits -> token ids
        return index if self.draft_ids is None else self.draft_ids[index]


register_kind(DrafterKind(
    name=KIND_NAME, config=EagleConfig, build=EagleHead, module=EagleHead,
    summary="EAGLE heads: the target's next feature from (feature, next token), drafting an EAGLE-2 dynamic tree",
))

"""The fused chain head: what EAGLE-3 and P-EAGLE heads share, laid out as vLLM's `speculators` package defines
`eagle3` (so it exports and imports without conversion of the maths, only of names).

At position t the head reads (by default) three intermediate target layers at t and the embedding of token
x_{t+1}, and drafts x_{t+2} with its own LM head over a reduced draft vocabulary:

    g = fc(cat(h_a, h_b, h_c))                                        fc: 3H -> H, no bias
    x = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g))          2H wide: the first layer's q/k/v read 2H
    x = g + attn(x); x = x + mlp(post_attention_layernorm(x))         residual: g (hidden_norm(g) with
                                                                      norm_before_residual)
    ... further standard decoder layers ...
    logits = lm_head(norm(x))                                         over the draft vocabulary only

Later draft steps read the head's own pre-norm output `x` (post-norm with `norm_output`) in place of `g`. The
layout flags of speculators (`ChainLayout`) are declared and checked once here, for the head configs and for the
recipes' `heads:` sections alike. A kind (`specheads.heads.eagle3`, `specheads.heads.peagle`) extends
`FusedChainConfig` and `FusedChainHead` with its own name and additions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from specheads.checked import Checked
from specheads.draft_layers import draft_layer_classes, draft_layer_config
from specheads.heads.fused_head import FusedHead, check_fused_config
from specheads.hf import cache_kwargs, decoder_of


@dataclass(frozen=True, kw_only=True)
class ChainLayout(Checked):
    """speculators' layout flags of a fused chain head, each an option of its maths (module doc)."""

    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(g) instead of g
    norm_before_fc: bool = False  # one RMSNorm over cat(aux states) before fc (`input_norm`)
    fc_norm: bool = False  # one RMSNorm per aux state before fc (`fc_norm.i`)
    norm_output: bool = False  # later draft steps read the post-norm output (speculators' "Eagle 3.1")

    def _check(self) -> None:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other: set one of them")


@dataclass(frozen=True)
class FusedChainConfig(ChainLayout):
    """What a fused chain head is (a kind's config extends it, naming its `KIND`); saved as its checkpoint's
    `config`."""

    KIND: ClassVar[str] = "fused chain"  # the kind its messages name (a subclass's own)

    hidden_size: int  # the target's hidden size H (also the head's)
    vocab_size: int  # rows of the target's LM head (the target vocabulary)
    aux_layers: tuple[int, ...]  # target hidden_states indices fused by fc
    # (speculators' eagle_aux_hidden_state_layer_ids)
    num_layers: int = 1  # decoder layers in the head; the first reads 2H
    draft_vocab: tuple[int, ...] | None = None  # target ids of the LM head's rows, sorted; None: the whole vocabulary
    layer: dict[str, Any] = field(default_factory=dict)  # draft layer config fields set apart from the target's

    def _check(self) -> None:
        check_fused_config(self, self.KIND)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)



class FusedChainHead(FusedHead):
    """The head of the module doc, built from a `FusedChainConfig` (or a kind's config extending it)."""

    def __init__(self, config: FusedChainConfig, target: nn.Module) -> None:
        super().__init__()
        layer_cfg = draft_layer_config(target, config.hidden_size, config.aux_layers, config.num_layers, config.KIND,
                                       config.layer)
        self.config = config
        decoder = decoder_of(target)
        self.layer_config = layer_cfg
        h, n, eps = config.hidden_size, len(config.aux_layers), layer_cfg.rms_norm_eps
        classes = draft_layer_classes(target)
        norm_cls = classes.norm
        if config.norm_before_fc:
            self.input_norm = norm_cls(n * h, eps=eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(norm_cls(h, eps=eps) for _ in range(n))
        self.fc = nn.Linear(n * h, h, bias=False)
        self.layers = nn.ModuleList(classes.layer(layer_cfg, layer_idx=i) for i in range(config.num_layers))
        first = self.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):  # the first layer reads cat(embedding, hidden): 2H
            old = getattr(first.self_attn, name)
            setattr(first.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        first.hidden_norm = norm_cls(h, eps=eps)
        self._add_output(target, decoder, layer_cfg, classes)
        self._to_target_dtype(target)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., H]: fc over the aux states
        # the last layer's columns are the training target, not an input
        aux = features[..., : -self.config.hidden_size]
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] tokens x_{t+1}
        features: torch.Tensor,  # [B, T, D] target features (fused here) or [B, T, H] the head's own outputs
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, 1, T, S] additive; None = causal, no cache prefix
        cache: Any = None,  # an HF Cache holding earlier positions (inference, training-time test)
    ) -> torch.Tensor:  # [B, T, H]: what the next draft step reads; draft_logits turns it into tokens
        with torch.no_grad():
            emb = self.embed_tokens(input_ids)
        hidden = features if features.shape[-1] == self.config.hidden_size else self.fuse_features(features)
        pos = self.rotary_emb(hidden, position_ids=position_ids)
        extra = cache_kwargs(self.layers[0], cache) if cache is not None else {}
        first = self.layers[0]
        residual = hidden
        normed = first.hidden_norm(hidden)
        if self.config.norm_before_residual:
            residual = normed
        x = torch.cat([first.input_layernorm(emb.to(hidden.dtype)), normed], dim=-1)
        attn = first.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                               position_embeddings=pos, **extra)
        x = residual + (attn[0] if isinstance(attn, tuple) else attn)
        x = x + first.mlp(first.post_attention_layernorm(x))
        for layer in self.layers[1:]:
            out = layer(x, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=pos, **extra)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x) if self.config.norm_output else x

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

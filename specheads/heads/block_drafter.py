"""A block drafter on the target's states (DFlash's design, which the `dflash`, `dspark`, `xpress` and `dflash2` kinds
share): a few decoder layers that fill a block of masked positions in one forward, reading the target's hidden states
as extra keys and values at every layer; laid out as vLLM's `speculators` package defines `dflash` (Qwen3-style
attention with per-head q/k norms, whatever the target's architecture), so it exports by writing a config.

With committed tokens x_0..x_n (x_n the last, whose target hidden state is not known yet) the block is
[x_n, mask, ..., mask] at positions n .. n+B-1 (B = `block_size`):

    c_p = hidden_norm(fc(cat(aux hidden states at p)))               p < n: the context, one row per position
    layer:  q, k, v from input_layernorm(block);  keys = [k_proj(c) | k], values = [v_proj(c) | v]
            (per-head RMSNorm on q and k, RoPE at each entry's position; every slot sees the whole context and
            the whole block)
    logits = lm_head(norm(block))                                    over the draft vocabulary

Which slot drafts which token is the kind's (`DraftBlock.first_slot`): from slot `first_slot` on, slot s drafts
x_{n+s+1-first_slot}, so one forward drafts B - first_slot tokens. The context rows enter every layer's keys and
values through that layer's own k/v projections (never its input norm) and are cached at inference; the block's
entries are recomputed each step. The token embedding is the target's (frozen, not saved); the LM head starts as the
target's rows of the draft vocabulary and the final norm as the target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from specheads.checked import Checked
from specheads.draft_layers import draft_layer_classes, draft_layer_config
from specheads.heads.fused_head import FusedHead, MaskEntries, check_fused_config, with_mask_token
from specheads.hf import decoder_of


@dataclass(frozen=True, kw_only=True)
class DraftBlock(MaskEntries, Checked):
    """What a block drafter's block is, declared and checked here only: a kind's head config and its recipe's
    `heads:` section both take it (through the kind's subclass naming its `KIND`)."""

    KIND: ClassVar[str] = "block drafter"  # the kind its messages name (a subclass's own)
    block_size: int = 4  # block length B: the anchor (last committed token) and B-1 masked positions

    def _check(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"{self.KIND} block_size must be >= 2 (the anchor and at least one drafted position; "
                             f"heads.block_size in a recipe), got {self.block_size}")

    @property
    def first_slot(self) -> int:
        """The first slot that drafts: 1 where the anchor's own slot drafts nothing (its output is the bonus
        token's place)."""
        return 1

    @property
    def drafted(self) -> int:
        """Tokens one forward drafts: the slots from `first_slot` on."""
        return self.block_size - self.first_slot


@dataclass(frozen=True, kw_only=True)
class AnchorSlotBlock(DraftBlock):
    """A block whose anchor's slot may draft too (speculators' `sample_from_anchor`: dspark, xpress, dflash2)."""

    sample_from_anchor: bool = False  # the anchor's slot drafts too (B tokens a forward); false: B - 1, as DFlash

    @property
    def first_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1


@dataclass(frozen=True)
class BlockDrafterConfig(DraftBlock):
    """What a block drafter is; a kind's config extends it (naming its `KIND`) and is saved as its checkpoint's
    `config`."""

    hidden_size: int  # the target's hidden size H (also the drafter's)
    vocab_size: int  # rows of the target's LM head (the target vocabulary)
    aux_layers: tuple[int, ...]  # target hidden_states indices fused by fc (speculators' aux_hidden_state_layer_ids)
    num_layers: int = 1  # draft decoder layers
    draft_vocab: tuple[int, ...] | None = None  # target ids of the LM head's rows, sorted; None: the whole vocabulary
    layer: dict[str, Any] = field(default_factory=dict)  # draft layer config fields set apart from the target's

    def _check(self) -> None:
        check_fused_config(self, self.KIND)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, h, n, d]; cos/sin [B, n, d]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, kv_heads, C, d]
LayerContext = KV | list[KV]  # one layer's context: batched (under a mask), or one pair per row
ContextKV = list[LayerContext]  # per layer


class BlockAttention(nn.Module):
    def __init__(self, cfg: Any, norm_cls: type[nn.Module]) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = norm_cls(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = norm_cls(self.head_dim, eps=cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, n, heads*d] -> [B, heads, n, d]
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, H] -> keys and values [B, kv_heads, n, d] (keys normed and rotated)."""
        k = _rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), *rope)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: LayerContext,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] (normed block); `context` the layer's context keys/values, [B, kv, C, d] each under `mask`
        [B, 1, Q, C+Q] (additive; None: all visible), or one pair per row, each [1, kv, C_r, d], every row attending
        over its own (so a row's result is the one it gets alone)."""
        q = _rope(self.q_norm(self._split(self.q_proj(x), self.heads)), *rope)
        k, v = self.keys_values(x, rope)
        if isinstance(context, list):
            out = torch.cat([self._attend(q[r : r + 1], k[r : r + 1], v[r : r + 1], kv, None)
                             for r, kv in enumerate(context)])
        else:
            out = self._attend(q, k, v, context, mask)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:  # -> [B, heads, Q, d]
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


class BlockLayer(nn.Module):
    def __init__(self, cfg: Any, norm_cls: type[nn.Module], mlp_cls: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = BlockAttention(cfg, norm_cls)
        self.mlp = mlp_cls(cfg)
        self.input_layernorm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: LayerContext,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafterHead(FusedHead):
    """The layers, context and output of a block drafter (the module doc); a kind subclasses it."""

    def __init__(self, config: BlockDrafterConfig, target: nn.Module) -> None:
        super().__init__()
        config = with_mask_token(config, target)
        layer_cfg = draft_layer_config(target, config.hidden_size, config.aux_layers, config.num_layers, config.KIND,
                                       config.layer)
        limit = getattr(layer_cfg, "max_position_embeddings", None)
        if limit is not None and config.block_size >= limit:
            raise ValueError(f"{config.KIND} block_size {config.block_size} does not fit the target's context of "
                             f"{limit} positions; use a block of a few tokens (4-16)")
        self.config = config
        self.layer_config = layer_cfg
        decoder = decoder_of(target)
        h, n, eps = config.hidden_size, len(config.aux_layers), layer_cfg.rms_norm_eps
        classes = draft_layer_classes(target)
        norm_cls, mlp_cls = classes.norm, classes.mlp
        self.fc = nn.Linear(n * h, h, bias=False)
        self.hidden_norm = norm_cls(h, eps=eps)
        self.layers = nn.ModuleList(self.make_layer(layer_cfg, norm_cls, mlp_cls) for _ in range(config.num_layers))
        self._add_output(target, decoder, layer_cfg, classes)
        self._to_target_dtype(target)

    def make_layer(self, cfg: Any, norm_cls: type[nn.Module], mlp_cls: type[nn.Module]) -> nn.Module:
        """One draft layer (a kind whose layers wrap more around attention and MLP builds its own; `self.config` is
        set by then)."""
        return BlockLayer(cfg, norm_cls, mlp_cls)

    @property
    def compute_dtype(self) -> torch.dtype:  # its activations' (an int8 drafter keeps its norms in it)
        return self.hidden_norm.weight.dtype

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(x, position_ids=positions)
        return cos.to(x.dtype), sin.to(x.dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Target feature rows [B, C, D] at `positions` [B, C] -> every layer's context keys and values."""
        aux = features[..., : -self.config.hidden_size]  # the last layer's columns are the training target only
        ctx = self.hidden_norm(self.fc(aux.to(self.compute_dtype)))
        rope = self._rope(ctx, positions)
        return [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, context: ContextKV,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block: tokens [B, Q] (anchors and mask tokens) at positions [B, Q], over `context` (`context_kv`, per
        layer batched under an additive mask [B, 1, Q, C+Q], or per row with every slot seeing all of its row's)
        -> [B, Q, H] for `draft_logits`."""
        with torch.no_grad():
            x = self.embed_tokens(tokens).to(self.compute_dtype)
        rope = self._rope(x, positions)
        for layer, kv in zip(self.layers, context):
            x = layer(x, rope, kv, mask)
        return x

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        return self.lm_head(self.norm(hidden))

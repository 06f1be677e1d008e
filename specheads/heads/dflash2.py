"""DFlash2 block drafter: a DFlash drafter (`specheads.heads.block_drafter`) whose layers wrap attention and MLP in
grouped dynamic causal convolutions over the block's slots, and whose drafts are reranked by a low-rank candidate
selector that reads the token drafted before each slot; laid out as vLLM's `speculators` package defines `dflash2`.

The block is [x_n, mask, ..., mask] at positions n .. n+B-1, as DFlash's. By default (`sample_from_anchor: false`,
speculators' convention for dflash2) slot s >= 1 drafts x_{n+s}; with `sample_from_anchor` the anchor's slot drafts
too (slot s drafts x_{n+s+1}).

Each layer (K = `conv_kernel_size` taps, channel groups of `conv_group_size`, g(c) the group of channel c):

    conv(u; z, W)_s[c] = Σ_{t < K, t <= s} (W[t, c] + z_s[t, g(c)]) · u_{s-t}[c]      within each block, causal
    z_in, z_out = split(P · u)                             P: [2·K·G, H], one projection of the sublayer's input u
    x = x + conv(attn(conv(u; z_in, W_0)); z_out, W_1)     u = input_layernorm(x)
    x = x + conv(mlp(conv(u; z_in, W_0)); z_out, W_1)      u = post_attention_layernorm(x), its own P, W

W starts as the identity tap (W[0] = 1, the rest 0) and P at zero, so a fresh drafter's layers are DFlash's. The
kernel of a slot's output reads that slot's own input (a token-conditioned kernel); the context rows never pass
through a convolution.

The candidate selector, per slot s with h_s = norm(block output), unary logits l_s = lm_head(h_s) and previous token
p (the anchor for the first drafted slot, else the token drafted before; at training the text's, teacher forcing):

    candidates  C_s = top-k of l_s                                         k = `selector_top_k`
    score(c)    = l_s[c] + Σ_r E_pred[p, r] · (A h_s)_r · E_succ[c, r]      c in C_s; rank r = `selector_rank`

E_pred, E_succ [V, r] index the target vocabulary and A [r, H] projects the hidden state. The scores order the
candidates (decoding's tree); which token the target accepts is the verifier's alone.

As speculators' dflash2 requires, the drafter scores the target's whole vocabulary with the target's own LM head,
frozen and never saved (rebuilt from the target when loaded); its final norm is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from specheads.heads.block_drafter import (
    AnchorSlotBlock,
    BlockDrafterConfig,
    BlockDrafterHead,
    BlockLayer,
    LayerContext,
)
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "dflash2"
_LM_HEAD = "lm_head."  # the target's own LM head: frozen, never saved


@dataclass(frozen=True, kw_only=True)
class DFlash2Block(AnchorSlotBlock):
    """What a DFlash2 drafter's block, convolutions and selector are: `DFlash2Config` and a dflash2 recipe's `heads:`
    section (`specheads.train.dflash2`) both take it."""

    KIND: ClassVar[str] = KIND_NAME
    conv_kernel_size: int = 2  # K, the causal taps of each convolution (the slot itself and K - 1 before it)
    conv_group_size: int = 16  # hidden channels sharing one dynamic kernel coefficient (must divide hidden_size)
    selector_rank: int = 256  # r, the rank of the candidate selector's bilinear score
    selector_top_k: int = 16  # candidates the selector reranks at each slot (the unary logits' top-k)

    def _check(self) -> None:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"dflash2 {name} must be >= 1 (heads.{name} in a recipe), got {getattr(self, name)}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"dflash2 conv_kernel_size {self.conv_kernel_size} reaches past a block of "
                             f"{self.block_size} slots; use conv_kernel_size <= block_size")


@dataclass(frozen=True)
class DFlash2Config(BlockDrafterConfig, DFlash2Block):
    """What a DFlash2 drafter is; saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME

    def _check(self) -> None:
        if self.draft_vocab is not None:
            raise ValueError("dflash2 scores the target's whole vocabulary with the target's own LM head, as "
                             "speculators' dflash2 requires; set draft_vocab_size: null in the recipe")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"dflash2 conv_group_size {self.conv_group_size} does not divide the hidden size "
                             f"{self.hidden_size}; pick a divisor of it (e.g. 16)")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"dflash2 selector_top_k {self.selector_top_k} exceeds the target vocabulary "
                             f"({self.vocab_size}); use fewer candidates")


def grouped_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
    """The module doc's conv over blocks laid end to end: x [..., Q, H] (Q a multiple of `block`, each run of
    `block` slots one block), the token kernels delta [..., Q, K, G] and the base kernel [K, H] -> [..., Q, H]."""
    *lead, q, h = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    xs = x.reshape(*lead, q // block, block, groups, h // groups)
    ds = delta.reshape(*lead, q // block, block, taps, groups)
    out = torch.zeros_like(xs)
    for t in range(taps):
        # slot s reads slot s - t of its own block; the first t slots have nothing that far back
        shifted = xs if t == 0 else torch.cat([torch.zeros_like(xs[..., :t, :, :]), xs[..., :-t, :, :]], dim=-3)
        out = out + shifted * (base[t].to(x.dtype).view(groups, h // groups) + ds[..., t, :, None])
    return out.reshape(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    """The input- and output-side convolutions around one sublayer (names as speculators'
    `GroupedDynamicCausalConv`): base kernels [2, K, H] and one projection to both sides' token kernels."""

    def __init__(self, hidden_size: int, block: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.block, self.taps, self.groups = block, taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        with torch.no_grad():  # the identity: the sublayer's input and output pass unchanged
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input u [B, Q, H] convolved, and the output side's token kernels [B, Q, K, G]."""
        kernels = self.kernel_projection(u).view(*u.shape[:-1], 2, self.taps, self.groups)
        return grouped_causal_conv(u, kernels[..., 0, :, :], self.base_kernel[0], self.block), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [B, Q, H] convolved with the kernels `prepare` returned."""
        return grouped_causal_conv(y, kernels, self.base_kernel[1], self.block)


class DFlash2Layer(BlockLayer):
    """A block layer with both sublayers wrapped in convolutions (speculators' `Qwen3DFlash2DecoderLayer`)."""

    def __init__(self, cfg: Any, norm_cls: type[nn.Module], mlp_cls: type[nn.Module], block: int, taps: int,
                 group_size: int) -> None:
        super().__init__(cfg, norm_cls, mlp_cls)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, block, taps, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, block, taps, group_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: LayerContext,
                mask: torch.Tensor | None) -> torch.Tensor:
        u, kernels = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, rope, context, mask), kernels)
        u, kernels = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), kernels)


class CandidateSelector(nn.Module):
    """The bilinear score of a candidate after a previous token at a slot (the module doc); names as speculators'
    `CandidateSelector`."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=init_std)

    def context(self, normed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Slots' normed hidden [..., H] and previous tokens [...] -> E_pred[p] ⊙ A h [..., r]."""
        pred = self.predecessor_codebook[prev.long()]
        return pred * self.hidden_projection(normed).to(pred.dtype)

    def scores(self, unary: torch.Tensor, normed: torch.Tensor, prev: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """Candidates' scores [..., k]: unary logits [..., V], normed hidden [..., H], previous tokens [...] and
        candidate ids [..., k]."""
        transition = (self.context(normed, prev).unsqueeze(-2) * self.successor_codebook[candidates.long()]).sum(-1)
        return unary.gather(-1, candidates) + transition.to(unary.dtype)


class DFlash2Head(BlockDrafterHead):
    config: DFlash2Config

    def __init__(self, config: DFlash2Config, target: nn.Module) -> None:
        super().__init__(config, target)
        with torch.no_grad():  # the target's rows as they are (speculators' dflash2 takes its verifier's head)
            self.lm_head.weight.copy_(target.get_output_embeddings().weight)
        self.lm_head.requires_grad_(False)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank,
                                                    config.selector_top_k,
                                                    float(getattr(self.layer_config, "initializer_range", 0.02)))
        self._to_target_dtype(target)

    def make_layer(self, cfg: Any, norm_cls: type[nn.Module], mlp_cls: type[nn.Module]) -> nn.Module:
        c = self.config
        return DFlash2Layer(cfg, norm_cls, mlp_cls, c.block_size, c.conv_kernel_size, c.conv_group_size)

    def previous_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The previous token of every slot [N, B] from the text at the block's positions [N, B] (the anchor first):
        the token at the slot's own position where the anchor's slot drafts, else the one before it (the anchor's
        slot, which drafts nothing then, gets the anchor)."""
        if self.config.sample_from_anchor:
            return tokens
        return torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)

    def candidates(self, unary: torch.Tensor, normed: torch.Tensor, prev: torch.Tensor,
                   candidates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots' unary logits [..., V], normed hidden [..., H] and previous tokens [...] -> the candidate ids
        [..., k] (`candidates`, else the unary top-k) and their selector scores [..., k]."""
        if candidates is None:
            candidates = unary.topk(self.config.selector_top_k, dim=-1).indices
        return candidates, self.candidate_selector.scores(unary, normed, prev, candidates)


register_kind(DrafterKind(
    name=KIND_NAME, config=DFlash2Config, build=DFlash2Head, module=DFlash2Head, shared_prefixes=(_LM_HEAD,),
    summary="DFlash2 block drafter: DFlash's block with grouped dynamic causal convolutions around every sublayer "
            "and a low-rank candidate selector reranking each slot's top-k (speculators' dflash2 layout)",
))

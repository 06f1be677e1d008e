"""XPress block drafter: a DFlash drafter (`specheads.heads.block_drafter`) plus a low-rank causal refiner, which
adds to each slot's logits a bias read from the tokens before it across the block, resolved at decode time by a few
parallel Jacobi passes instead of a slot-by-slot loop; laid out as vLLM's `speculators` package defines `xpress`.

The block is [x_n, mask, ..., mask] at positions n .. n+B-1, as DFlash's. By default (`sample_from_anchor: false`,
speculators' convention for xpress) slot s >= 1 drafts x_{n+s} and the anchor's slot drafts nothing; with
`sample_from_anchor` slot s drafts x_{n+s+1}. Each slot s has a *previous token* t_s: the token at the position before
the one it drafts (without `sample_from_anchor` the anchor's slot gets x_{n-1}, the token before the anchor, or the
anchor itself at the text's start; the slots after it get x_n, then the drafted tokens). With h_s = norm(block output)
(every slot's, the anchor's included) and r the refiner's rank:

    a_s    = in_proj([down_h(h_s); down_g(mean_j h_j); E[t_s]])        [r]: slot, block summary, previous token
    c_s    = a_s + Σ_{j<=s} L[:, s, j] ⊙ a_j                           the causal mixer, one [B, B] matrix per channel
    u_s    = c_s + mlp_down(silu(mlp_gate(c_s)) ⊙ mlp_up(c_s))         a SwiGLU MLP in r-space, width r · mlp_ratio
    logits_s = lm_head(h_s) + readout(u_s)                            over the draft vocabulary

E [V, r] indexes the target vocabulary, readout [Vd, r] projects to the draft vocabulary. The bias of slot s reads
t_0 .. t_s only, so the slots could be drafted one by one; decoding instead runs Jacobi passes over the whole block:
the first pass reads the argmax of the block's logits without bias as the drafted tokens, every later pass those of
the pass before (`num_jacobi_passes` passes, 0: no refinement), stopping early once a pass drafts what the one before
it drafted (every further pass would repeat it). Training feeds the text's own previous tokens (teacher forcing) and
a few such passes (`specheads.train.xpress`). L starts at zero and the rest at N(0, 0.02²), as speculators starts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.block_drafter import AnchorSlotBlock, BlockDrafterConfig, BlockDrafterHead
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "xpress"


@dataclass(frozen=True, kw_only=True)
class XPressBlock(AnchorSlotBlock):
    """What an XPress drafter's block and refiner are: `XPressConfig` and an xpress recipe's `heads:` section
    (`specheads.train.xpress`) both take it."""

    KIND: ClassVar[str] = KIND_NAME
    xpress_rank: int = 256  # r, the refiner's width (its embedding, projections, mixer and MLP live in r-space)
    xpress_mlp_ratio: int = 2  # the refiner MLP's hidden width is r times this
    num_jacobi_passes: int = 6  # refine passes a decoding step runs (K); 0: the block's logits without the bias

    def _check(self) -> None:
        if self.xpress_rank < 1:
            raise ValueError(f"xpress xpress_rank must be >= 1 (heads.xpress_rank in a recipe; speculators' default "
                             f"is 256), got {self.xpress_rank}")
        if self.xpress_mlp_ratio < 1:
            raise ValueError(f"xpress xpress_mlp_ratio must be >= 1 (heads.xpress_mlp_ratio in a recipe; 2 in "
                             f"speculators' checkpoints), got {self.xpress_mlp_ratio}")
        if self.num_jacobi_passes < 0:
            raise ValueError(f"xpress num_jacobi_passes must be >= 0 (0: no refinement; heads.num_jacobi_passes in a "
                             f"recipe), got {self.num_jacobi_passes}")


@dataclass(frozen=True)
class XPressConfig(BlockDrafterConfig, XPressBlock):
    """What an XPress drafter is; saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME


class CausalRefiner(nn.Module):
    """The refiner's bias of every slot of blocks (the module doc); names as speculators' `XPressRefinerHead`."""

    causal: torch.Tensor  # [B, B] lower triangle of ones: slot s reads slots j <= s

    def __init__(self, vocab_size: int, draft_vocab_size: int, hidden_size: int, block_size: int, rank: int,
                 mlp_ratio: int) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))  # [r, B, B], read below the diagonal
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, draft_vocab_size, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(block_size, block_size)), persistent=False)
        with torch.no_grad():  # the mixer at zero: each slot starts reading its own inputs only
            for module in (self.token_embed, self.down_h, self.down_g, self.in_proj, self.mlp_gate, self.mlp_up,
                           self.mlp_down, self.readout):
                module.weight.normal_(std=0.02)

    def hidden_cache(self, normed: torch.Tensor) -> torch.Tensor:
        """What every pass shares: [down_h(h_s); down_g(mean of the block's h)] [..., B, 2r] from the slots' normed
        outputs [..., B, H]."""
        summary = normed.mean(dim=-2, keepdim=True).expand_as(normed)
        return torch.cat([self.down_h(normed), self.down_g(summary)], dim=-1)

    def forward(self, cache: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The bias [..., B, Vd] of blocks from their `hidden_cache` [..., B, 2r] and previous tokens [..., B]."""
        emb = self.token_embed(prev).to(cache.dtype)
        a = self.in_proj(torch.cat([cache, emb], dim=-1))  # [..., B, r]
        mixer = self.mix_l * self.causal.to(self.mix_l.dtype)  # [r, B, B]
        c = a + torch.einsum("rkj,...jr->...kr", mixer.to(a.dtype), a)
        u = c + self.mlp_down(F.silu(self.mlp_gate(c)) * self.mlp_up(c))
        return self.readout(u)


class XPressHead(BlockDrafterHead):
    config: XPressConfig

    def __init__(self, config: XPressConfig, target: nn.Module) -> None:
        super().__init__(config, target)
        self.refiner_head = CausalRefiner(config.vocab_size, config.draft_vocab_size, config.hidden_size,
                                          config.block_size, config.xpress_rank, config.xpress_mlp_ratio)
        self._to_target_dtype(target)

    def refined(self, base: torch.Tensor, cache: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The logits [..., B, Vd] of blocks: their logits without the bias [..., B, Vd] plus the refiner's, from
        `hidden_cache` [..., B, 2r] and the slots' previous tokens [..., B]."""
        return base + self.refiner_head(cache, prev).to(base.dtype)

    def previous_tokens(self, tokens: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """The previous token of every slot [N, B] from tokens at the block's positions [N, B] (the anchor first:
        the text's at training, the drafted ones at decoding) and the token before each anchor [N] (the anchor
        itself at the text's start): the token at the slot's own position where the anchor's slot drafts, else the
        one before it."""
        if self.config.sample_from_anchor:
            return tokens
        return torch.cat([before[:, None], tokens[:, :-1]], dim=1)

    def jacobi_tokens(self, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The tokens at the block's positions [N, B] a pass reads from the last logits [N, B, Vd]: their argmax as
        token ids, the anchor [N] in front (without `sample_from_anchor`, where slot 0 drafts nothing, in its place)."""
        drafted = self.token_ids(logits.argmax(-1))
        if self.config.sample_from_anchor:
            return torch.cat([anchor[:, None], drafted[:, :-1]], dim=1)
        return torch.cat([anchor[:, None], drafted[:, 1:]], dim=1)

    def resolve(self, normed: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, before: torch.Tensor,
                passes: int | None = None) -> torch.Tensor:
        """The logits [N, B, Vd] after `passes` Jacobi passes (default `num_jacobi_passes`) over blocks with normed
        outputs [N, B, H], logits without the bias [N, B, Vd], anchors [N] and the tokens before them [N]; stops
        early at a fixed point of every block (a further pass would repeat it)."""
        passes = self.config.num_jacobi_passes if passes is None else passes
        if passes == 0:
            return base
        cache = self.refiner_head.hidden_cache(normed)
        logits, drafted = base, None
        for _ in range(passes):
            tokens = self.jacobi_tokens(logits, anchor)
            if drafted is not None and torch.equal(tokens, drafted):
                break
            drafted = tokens
            logits = self.refined(base, cache, self.previous_tokens(tokens, before))
        return logits


register_kind(DrafterKind(
    name=KIND_NAME, config=XPressConfig, build=XPressHead, module=XPressHead,
    summary="XPress block drafter: DFlash's block plus a low-rank causal refiner over the block's previous tokens, "
            "resolved by parallel Jacobi passes (speculators' xpress layout)",
))

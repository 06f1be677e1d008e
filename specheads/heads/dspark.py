"""DSpark block drafter: a DFlash drafter (`specheads.heads.block_drafter`) plus a low-rank Markov logit bias, which
lets each drafted token depend on the token drafted before it, and a confidence head, which estimates each slot's
chance of being accepted; laid out as vLLM's `speculators` package defines `dspark`.

The block is [x_n, mask, ..., mask] at positions n .. n+B-1, as DFlash's. By default (`sample_from_anchor`,
speculators' convention for dspark) the anchor's own slot drafts too: slot s drafts x_{n+s+1}, so one forward drafts
B tokens; with `sample_from_anchor: false` (DFlash's convention) slot s >= 1 drafts x_{n+s}. Either way the
*previous token* of the slot drafting the d-th next token is the anchor x_n for d = 0 and the token drafted at d - 1
otherwise (at training: the text's own token there, teacher forcing). Per slot s, with h_s = norm(block output) and
e_s = W1[previous token of s]:

    logits_s = lm_head(h_s) + W2 · m_s                 m_s: e_s (`vanilla`), sigmoid(G [h_s; e_s] + g) ⊙ e_s
                                                       (`gated`), or tanh of a gated recurrence over the block's
                                                       slots from slot 0 on, fed [state; e_s; h_s] (`rnn`)
    confidence_s = proj([h_s; e_s])                    a logit of slot s's acceptance (only h_s without
                                                       `confidence_head_with_markov`)

W1 [V, r] indexes the target vocabulary, W2 [Vd, r] projects to the draft vocabulary (B = W1 W2ᵀ is the low-rank
bigram bias). W2 starts at zero, so a fresh drafter drafts as the DFlash drafter it extends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specheads.heads.block_drafter import AnchorSlotBlock, BlockDrafterConfig, BlockDrafterHead
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "dspark"
MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass(frozen=True, kw_only=True)
class DSparkBlock(AnchorSlotBlock):
    """What a DSpark drafter's block and heads are: `DSparkConfig` and a dspark recipe's `heads:` section
    (`specheads.train.dspark`) both take it."""

    KIND: ClassVar[str] = KIND_NAME
    sample_from_anchor: bool = True  # the anchor's slot drafts too (B tokens a forward); false: B - 1, as DFlash
    markov_rank: int = 256  # r, the rank of the Markov bias W1 W2ᵀ; 0: no Markov bias
    markov_head_type: str = "vanilla"  # how the previous token biases a slot: vanilla, gated or rnn (heads/dspark.py)
    enable_confidence_head: bool = True  # estimate each slot's acceptance (the node budget's estimates)
    confidence_head_with_markov: bool = True  # the confidence head also reads the previous token's W1 row

    def _check(self) -> None:
        if self.markov_rank < 0:
            raise ValueError(f"dspark markov_rank must be >= 0 (0: no Markov bias; heads.markov_rank in a recipe), "
                             f"got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"dspark markov_head_type must be one of {', '.join(MARKOV_HEADS)} "
                             f"(heads.markov_head_type in a recipe), got {self.markov_head_type!r}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("dspark confidence_head_with_markov needs the Markov bias's embedding; set "
                             "markov_rank > 0 or confidence_head_with_markov: false")


@dataclass(frozen=True)
class DSparkConfig(BlockDrafterConfig, DSparkBlock):
    """What a DSpark drafter is; saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME


class MarkovBias(nn.Module):
    """The logit bias of a slot from the token before it (the module doc); names as speculators' `MarkovHead`."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":  # [gate; candidate; output] from [state; previous token's row; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        with torch.no_grad():
            nn.init.normal_(self.markov_w1.weight, std=0.01)
            self.markov_w2.weight.zero_()  # no bias at first: the DFlash drafter's own drafts

    def mix_step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: the previous tokens' W1 rows [..., r] and the slot's normed hidden [..., H], with the recurrent
        state before the slot [..., r] (`rnn` only; None: zeros) -> what W2 projects [..., r], and the state after
        the slot (None but for `rnn`)."""
        if self.head_type == "vanilla":
            return prev_emb, None
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb, None
        state = torch.zeros_like(prev_emb) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(candidate)

    def mix(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Every slot of blocks at once: rows [..., B, r] and hidden [..., B, H] -> what W2 projects [..., B, r] (the
        recurrence runs from slot 0, its state starting at zero)."""
        if self.head_type != "rnn":
            return self.mix_step(prev_emb, hidden, None)[0]
        state, out = None, []
        for s in range(prev_emb.shape[-2]):
            m, state = self.mix_step(prev_emb[..., s, :], hidden[..., s, :], state)
            out.append(m)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    """A slot's acceptance logit from its features (names as speculators' `ConfidenceHead`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., F] -> [...]
        return self.proj(features).squeeze(-1)


class DSparkHead(BlockDrafterHead):
    config: DSparkConfig

    def __init__(self, config: DSparkConfig, target: nn.Module) -> None:
        super().__init__(config, target)
        h, r = config.hidden_size, config.markov_rank
        self.markov_head = MarkovBias(config.vocab_size, config.draft_vocab_size, r, h, config.markov_head_type) \
            if r > 0 else None
        width = h + (r if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.enable_confidence_head else None
        self._to_target_dtype(target)

    def slot_parts(self, hidden: torch.Tensor, prev: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every slot of blocks: outputs [..., B, H] (`forward`) and each slot's previous token [..., B]
        (`previous_tokens`) -> the normed hidden [..., B, H], what W2 projects [..., B, r] and the previous tokens'
        W1 rows [..., B, r] (both None without a Markov bias), for `slot_logits` and `confidence_logits`."""
        normed = self.norm(hidden)
        if self.markov_head is None:
            return normed, None, None
        emb = self.markov_head.markov_w1(prev)
        return normed, self.markov_head.mix(emb, normed), emb

    def slot_logits(self, normed: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:  # -> [..., Vd]
        """Draft logits with the Markov bias, from `slot_parts`' normed hidden [..., H] and mix [..., r]."""
        logits = self.lm_head(normed)
        return logits if mix is None else logits + self.markov_head.markov_w2(mix)

    def confidence_logits(self, normed: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        """Slots' acceptance logits [...] from their normed hidden [..., H] and previous tokens' W1 rows [..., r]
        (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            normed = torch.cat([normed, prev_emb.to(normed.dtype)], dim=-1)
        return self.confidence_head(normed)

    def block_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every slot of blocks, teacher forced: outputs [..., B, H] and previous tokens [..., B] -> draft logits
        [..., B, Vd] with the Markov bias, and confidence logits [..., B] (None without a confidence head)."""
        normed, mix, emb = self.slot_parts(hidden, prev)
        return self.slot_logits(normed, mix), self.confidence_logits(normed, emb)

    def previous_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The previous token of every slot [N, B] from the text at the block's positions [N, B] (the anchor first):
        the token at the slot's own position where the anchor's slot drafts, else the one before it (the anchor's
        slot, which drafts nothing then, gets the anchor)."""
        if self.config.sample_from_anchor:
            return tokens
        return torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)


register_kind(DrafterKind(
    name=KIND_NAME, config=DSparkConfig, build=DSparkHead, module=DSparkHead,
    summary="DSpark block drafter: DFlash's block plus a low-rank Markov bias on the previous drafted token and a "
            "per-slot confidence head (speculators' dspark layout)",
))

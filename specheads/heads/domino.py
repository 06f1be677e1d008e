"""Domino block drafter: a DFlash drafter (`specheads.heads.block_drafter`) whose logits get a causal correction read
from the tokens drafted before each slot through a small GRU; laid out as vLLM's `speculators` package defines it (its
`dflash` type with `projector_type: domino` and a `DominoHead`, the layout vLLM's Domino loader reads).

The block is [x_n, mask, ..., mask] at positions n .. n+B-1, as DFlash's, but the anchor's slot drafts too (Domino's
`shift_label: true`): slot s drafts x_{n+s+1}, so one forward drafts B tokens. Slot s's *previous token* t_s is the one
at the position before the one it drafts: the anchor x_n for slot 0, then the drafted tokens (at training the text's
own, teacher forcing). With h_s = norm(block output at slot s), e(t) the target's embedding row of token t and
P = `pure_draft_prefix_len`:

    g_s      = GRU(e(t_s), g_{s-1})                    g_{-1} = 0: one layer, no biases, width G = gru_hidden_dim
    base_s   = lm_head(h_s)                            DFlash's logits, with the target's own LM head
    logits_s = base_s + W2 silu(W1 [h_s; g_s])         for s >= P (the first P slots keep base_s)

with W1 [E, H+G] and W2 [V, E] (E = `emb_dim`): a rank-E correction over the full vocabulary. g_s reads the whole path
to slot s, so decoding drafts slot by slot after one block forward, each branch of its tree with its own GRU state.
W2 starts at zero: an untrained correction leaves DFlash's logits unchanged.

As speculators' Domino requires, the drafter scores the target's whole vocabulary, its base logits with the target's
own LM head, frozen and never saved (rebuilt from the target when loaded; speculators and its engines take their
verifier's for a full-vocabulary DFlash drafter); its final norm is its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.block_drafter import BlockDrafterConfig, BlockDrafterHead, DraftBlock
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "domino"
_LM_HEAD = "lm_head."  # the target's own LM head: frozen, never saved


@dataclass(frozen=True, kw_only=True)
class DominoBlock(DraftBlock):
    """What a Domino drafter's block and correction are: `DominoConfig` and a domino recipe's `heads:` section
    (`specheads.train.domino`) both take it."""

    KIND: ClassVar[str] = KIND_NAME
    # Sized for the default target, SmolLM2-135M (H 576, V 49152), not speculators' 1024 and 256 (sized for Qwen3-8B,
    # H 4096): the GRU's 3G(H+G) = 0.64M weights, W1's 53K and W2's V·E = 3.1M together stay near one draft layer's
    # 3.5M, where E = 256 would make W2 alone 12.6M, more than the rest of the drafter.
    gru_hidden_dim: int = 256  # G, the prefix GRU's state width
    emb_dim: int = 64  # E, the correction's bottleneck (its rank over the vocabulary)
    pure_draft_prefix_len: int = 1  # P, the leading slots drafted from DFlash's logits alone (speculators' default)

    def _check(self) -> None:
        for name in ("gru_hidden_dim", "emb_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"domino {name} must be >= 1 (heads.{name} in a recipe), got {getattr(self, name)}")
        if not 0 <= self.pure_draft_prefix_len < self.block_size:
            raise ValueError(f"domino pure_draft_prefix_len must be in [0, block_size) = [0, {self.block_size}) so the "
                             f"correction reaches some slot (heads.pure_draft_prefix_len in a recipe), got "
                             f"{self.pure_draft_prefix_len}")

    @property
    def first_slot(self) -> int:
        return 0  # the anchor's slot drafts x_{n+1} (Domino's shift_label)

    @property
    def suffix_start(self) -> int:
        """The first slot whose logits the correction refines."""
        return self.pure_draft_prefix_len


@dataclass(frozen=True)
class DominoConfig(BlockDrafterConfig, DominoBlock):
    """What a Domino drafter is; saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME

    def _check(self) -> None:
        if self.draft_vocab is not None:
            raise ValueError("domino's correction scores the target's whole vocabulary, as speculators' Domino "
                             "requires; set draft_vocab_size: null in the recipe")


class PrefixGRU(nn.Module):
    """A one-layer GRU without biases, stepped here: torch.nn.GRU's parameter names and gates (r, z, n), which
    speculators, SpecForge and vLLM load, and one step function for training's teacher-forced pass and decoding's
    slot-by-slot one, so both compute the same states (and in any dtype a CPU runs)."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih_l0 = nn.Parameter(torch.empty(3 * hidden_size, input_size))  # [3G, H]: W_ir, W_iz, W_in
        self.weight_hh_l0 = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))  # [3G, G]: W_hr, W_hz, W_hn
        bound = 1.0 / math.sqrt(hidden_size)  # torch.nn.GRU's initialisation
        for weight in (self.weight_ih_l0, self.weight_hh_l0):
            nn.init.uniform_(weight, -bound, bound)

    def _cell(self, gates: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The next state [..., G] from the input's gate pre-activations [..., 3G] and the state [..., G]."""
        ir, iz, inn = gates.chunk(3, dim=-1)
        hr, hz, hn = F.linear(state, self.weight_hh_l0).chunk(3, dim=-1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        return (1 - z) * torch.tanh(inn + r * hn) + z * state

    def step(self, x: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """One step: inputs [..., H] and states [..., G] (None: the zero start) -> the next states [..., G]."""
        if state is None:
            state = x.new_zeros(*x.shape[:-1], self.hidden_size)
        return self._cell(F.linear(x, self.weight_ih_l0), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every step's state [..., S, G] over sequences of inputs [..., S, H] from the zero start: the input
        projections in one product, then the recurrence."""
        gates = F.linear(x, self.weight_ih_l0)  # [..., S, 3G]
        state = x.new_zeros(*x.shape[:-2], self.hidden_size)
        states = []
        for s in range(x.shape[-2]):
            state = self._cell(gates[..., s, :], state)
            states.append(state)
        return torch.stack(states, dim=-2)


class DominoCorrection(nn.Module):
    """The prefix GRU and the correction W2 silu(W1 [h; g]) (the module doc), under speculators' `DominoHead` names."""

    def __init__(self, hidden_size: int, gru_hidden_dim: int, emb_dim: int, vocab_size: int) -> None:
        super().__init__()
        self.prefix_gru = PrefixGRU(hidden_size, gru_hidden_dim)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(emb_dim, vocab_size, bias=False))
        with torch.no_grad():  # no correction yet: a fresh drafter drafts as DFlash
            self.embed_proj[2].weight.zero_()

    def forward(self, normed: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The correction [..., V] of slots with normed outputs [..., H] and GRU states [..., G]."""
        return self.embed_proj(torch.cat([normed, state.to(normed.dtype)], dim=-1))


class DominoHead(BlockDrafterHead):
    config: DominoConfig
    # The share of its training run spent (0 -> 1), set by the recipe before each step (`train.domino`'s curriculum
    # reads it). Not a tensor: a resumed run's checkpoint gives it back (steps, minutes); a drafter keeps none.
    run_progress: float

    def __init__(self, config: DominoConfig, target: nn.Module) -> None:
        super().__init__(config, target)
        with torch.no_grad():  # the target's rows as they are (speculators' Domino takes its verifier's head)
            self.lm_head.weight.copy_(target.get_output_embeddings().weight)
        self.lm_head.requires_grad_(False)
        self.domino_head = DominoCorrection(config.hidden_size, config.gru_hidden_dim, config.emb_dim,
                                            config.vocab_size)
        self._to_target_dtype(target)
        self.run_progress = 0.0

    def gru_states(self, prev: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: every slot's GRU state [..., B, G] from the blocks' previous tokens [..., B] (the anchor,
        then the text's continuation)."""
        return self.domino_head.prefix_gru(self.embed_tokens(prev).to(self.compute_dtype))

    def gru_step(self, token: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Decoding: the state [R, G] after tokens [R], from the states before them [R, G] (None: the start)."""
        return self.domino_head.prefix_gru.step(self.embed_tokens(token).to(self.compute_dtype), state)

    def corrected(self, base: torch.Tensor, normed: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Slots' logits with the correction [..., V]: their base logits [..., V], normed outputs [..., H] and GRU
        states [..., G]."""
        return base + self.domino_head(normed, state).to(base.dtype)

    def teacher_forced_logits(self, normed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Every slot's logits [N, B, V] from blocks' normed outputs [N, B, H] and previous tokens [N, B], the
        correction from `suffix_start` on."""
        base = self.lm_head(normed)
        start = self.config.suffix_start
        late = self.corrected(base[:, start:], normed[:, start:], self.gru_states(prev)[:, start:])
        return torch.cat([base[:, :start], late], dim=1)


register_kind(DrafterKind(
    name=KIND_NAME, config=DominoConfig, build=DominoHead, module=DominoHead,
    shared_prefixes=(_LM_HEAD,),
    summary="Domino block drafter: DFlash's block plus a GRU over each slot's drafted prefix correcting its logits "
            "(speculators' DFlash layout with projector_type domino)",
))

"""EAGLE-3 draft head, laid out exactly as vLLM's `speculators` package defines `eagle3` (so it exports and
imports without conversion of the maths, only of names).

At position t the head reads three (by default) intermediate target layers at t and the embedding of token
x_{t+1}, and drafts x_{t+2} with its own LM head over a reduced draft vocabulary:

    g = fc(cat(h_a, h_b, h_c))                                        fc: 3H -> H, no bias
    x = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g))          2H wide: the first layer's q/k/v read 2H
    x = g + attn(x); x = x + mlp(post_attention_layernorm(x))         residual: g (hidden_norm(g) with norm_before_residual)
    ... further standard decoder layers ...
    logits = lm_head(norm(x))                                         over the draft vocabulary only

Unlike EAGLE-1 it predicts tokens, not features: later draft steps read the head's own pre-norm output `x`
(post-norm with `norm_output`) in place of `g`. Options of speculators kept as they are: `norm_before_fc`
(one RMSNorm over the concatenated aux states, `input_norm`), `fc_norm` (one RMSNorm per aux state),
`norm_before_residual`, `norm_output`.

The decoder layers are the target architecture's own classes (the first one with its q/k/v widened and a
`hidden_norm` added), so parameter names match speculators' checkpoints one for one. The token embedding
is the target's, frozen and not saved; the LM head and final norm are the head's own and start as the
target's (its LM head rows of the draft vocabulary, its final norm). The head is the fused chain head
(`specheads.heads.fused_chain`) as it is; P-EAGLE's extends it.

Draft vocabulary: `draft_vocab` lists the target token ids of the LM head's rows, sorted. speculators
writes the same mapping as `d2t` (target id = draft index + d2t[index]) and `t2d` (a mask over the
target vocabulary); `specheads.heads.draft_vocab` converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specheads.heads.fused_chain import FusedChainConfig, FusedChainHead
from specheads.kinds import DrafterKind, register_kind

KIND_NAME = "eagle3"


@dataclass(frozen=True)
class Eagle3Config(FusedChainConfig):
    """What an EAGLE-3 head is (`FusedChainConfig`); saved as its checkpoint's `config`."""

    KIND: ClassVar[str] = KIND_NAME


class Eagle3Head(FusedChainHead):
    """An EAGLE-3 head: the fused chain head as it is."""


register_kind(DrafterKind(
    name=KIND_NAME, config=Eagle3Config, build=Eagle3Head, module=Eagle3Head,
    summary="EAGLE-3 heads: tokens from three fused target layers with an own draft-vocabulary LM head "
            "(speculators' eagle3 layout), drafting an EAGLE-2 dynamic tree",
))

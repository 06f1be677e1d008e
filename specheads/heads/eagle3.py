"""EAGLE-3 draft head, laid out exactly as vLLM's `speculators` package defines `eagle3` (so it exports and
imports without conversion of the maths, only of names).

The layout and its maths are the shared fused chain head's (`specheads.heads.fused_chain`, whose docstring
shows them); this module declares the kind on top of it.

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

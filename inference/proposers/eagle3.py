"""`eagle3`: EAGLE-3 heads drafting the same EAGLE-2 dynamic tree as `eagle` (see `eagle.py`).

The tree search is EAGLE's; only the scoring differs: an EAGLE-3 head has its own final norm and LM head
over its draft vocabulary, so its drafts come from those (`Eagle3Head.draft_logits`), and no tokens of the
request can be added to what it scores. Drafts are deterministic top-k choices, so verification is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specheads.heads.eagle3 import KIND_NAME, Eagle3Head
from specheads.inference.methods import Method, register_method
from specheads.inference.proposers.eagle import EAGLE_TREES, EagleOptions, tree_proposer


class HeadVocabulary:
    """Scores an EAGLE-3 head's outputs with its own LM head over its draft vocabulary."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head

    def reset(self, tokens: torch.Tensor) -> None:
        pass

    def add(self, tokens: torch.Tensor) -> None:
        pass

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, Vd], fp32
        return self.head.draft_logits(hidden).float()

    @staticmethod
    def logits_rows(vocabs: Sequence[HeadVocabulary], hidden: torch.Tensor) -> torch.Tensor:  # [B, n, H] -> [B, n, Vd]
        if any(v.head is not vocabs[0].head for v in vocabs):
            raise ValueError("rows scored together must share the head")
        return vocabs[0].head.draft_logits(hidden).float()

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.head.token_ids(index)


register_method(Method(
    name=KIND_NAME, summary="EAGLE-3 heads drafting an EAGLE-2 dynamic tree, prompt lookup grafted on",
    options=EagleOptions, build=lambda target, options, load_draft: tree_proposer(target, options, KIND_NAME, HeadVocabulary),
    arg="heads", arg_hint="DIR", trees=EAGLE_TREES,
))

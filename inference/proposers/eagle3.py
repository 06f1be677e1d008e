"""`eagle3`: EAGLE-3 heads drafting the same EAGLE-2 dynamic tree as `eagle` (the search of `fused_tree`).

The tree search is EAGLE's; only the scoring differs: an EAGLE-3 head has its own final norm and LM head
over its draft vocabulary, so its drafts come from those (`HeadVocabulary`, through `Eagle3Head.draft_logits`),
and no tokens of the request can be added to what it scores. Drafts are deterministic top-k choices, so
verification is exact.
"""

from __future__ import annotations

from specheads.heads.eagle3 import KIND_NAME
from specheads.inference.engine.proposer import Proposer
from specheads.inference.methods.tree_options import TreeOptions
from specheads.inference.proposers.fused_tree import HeadVocabulary, tree_proposer


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `eagle3` method's proposer (`specheads.inference.methods.eagle3`)."""
    return tree_proposer(target, options, KIND_NAME, HeadVocabulary)

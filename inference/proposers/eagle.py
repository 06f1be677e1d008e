"""`eagle`: EAGLE heads drafting an EAGLE-2 dynamic tree (the fused-head tree search of `fused_tree`).

The head's drafts are scored by the target's LM head over the head's draft vocabulary, plus the request's own
tokens outside it (`ContextVocabulary`). Drafts are deterministic top-k choices, so verification is exact for
greedy and sampling alike (the verifier treats each draft as one-hot).
"""

from __future__ import annotations

from specheads.heads.eagle import KIND_NAME
from specheads.inference.engine.proposer import Proposer
from specheads.inference.methods.tree_options import TreeOptions
from specheads.inference.proposers.fused_tree import FusedTreeProposer, tree_proposer

EagleProposer = FusedTreeProposer  # EAGLE heads draft with the fused-head tree search as it is


def build(target, options: TreeOptions, load_draft) -> Proposer:
    """The `eagle` method's proposer (`specheads.inference.methods.eagle`)."""
    return tree_proposer(target, options, KIND_NAME)

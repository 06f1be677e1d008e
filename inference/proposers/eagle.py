"""`eagle`: EAGLE heads drafting an EAGLE-2 dynamic tree (the fused-head tree search of `fused_tree`).

The head's drafts are scored by the target's LM head over the head's draft vocabulary, plus the request's own
tokens outside it (`ContextVocabulary`). Drafts are deterministic top-k choices, so verification is exact for
greedy and sampling alike (the verifier treats each draft as one-hot).
"""

from __future__ import annotations

from specheads.heads.eagle import KIND_NAME
from specheads.inference.methods import Method, register_method
from specheads.inference.proposers.fused_tree import FusedTreeProposer, tree_proposer
from specheads.inference.proposers.tree_options import TREES, TreeOptions, named_tree

EagleProposer = FusedTreeProposer  # EAGLE heads draft with the fused-head tree search as it is
eagle_tree = named_tree  # the tree presets are every tree-drafting method's (`tree_options`)


register_method(Method(
    name=KIND_NAME, summary="EAGLE heads drafting an EAGLE-2 dynamic tree, prompt lookup grafted on",
    options=TreeOptions, build=lambda target, options, load_draft: tree_proposer(target, options, KIND_NAME),
    arg="heads", arg_hint="DIR", trees=TREES,
))

"""`domino`: a Domino block drafter (built by `specheads.inference.proposers.domino`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="domino", summary="a Domino block drafter: one forward fills a block, then each branch of the tree is drafted "
                           "slot by slot, corrected by a GRU over its own tokens, prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.domino:build", arg="heads", arg_hint="DIR", trees=TREES,
))

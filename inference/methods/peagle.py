"""`peagle`: P-EAGLE heads drafting a block per forward (built by `specheads.inference.proposers.peagle`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="peagle", summary="P-EAGLE heads drafting a block per forward, expanded into a tree, prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.peagle:build", arg="heads", arg_hint="DIR", trees=TREES,
))

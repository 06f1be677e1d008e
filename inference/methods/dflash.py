"""`dflash`: a DFlash block drafter (built by `specheads.inference.proposers.dflash`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="dflash", summary="a DFlash block drafter: one forward fills a block, expanded into a tree, prompt lookup "
                           "grafted on",
    options=TreeOptions, build="specheads.inference.proposers.dflash:build", arg="heads", arg_hint="DIR", trees=TREES,
))

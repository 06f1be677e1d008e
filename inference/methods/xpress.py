"""`xpress`: an XPress block drafter (built by `specheads.inference.proposers.xpress`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="xpress", summary="an XPress block drafter: one forward fills a block, its causal refiner resolved by "
                           "Jacobi passes, expanded into a tree, prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.xpress:build", arg="heads", arg_hint="DIR", trees=TREES,
))

"""`dspark`: a DSpark block drafter (built by `specheads.inference.proposers.dspark`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="dspark", summary="a DSpark block drafter: one forward fills a block, drafted into a tree token by token "
                           "(each branch's Markov bias), prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.dspark:build", arg="heads", arg_hint="DIR", trees=TREES,
))

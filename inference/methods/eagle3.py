"""`eagle3`: EAGLE-3 heads drafting an EAGLE-2 dynamic tree (built by `specheads.inference.proposers.eagle3`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="eagle3", summary="EAGLE-3 heads drafting an EAGLE-2 dynamic tree, prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.eagle3:build", arg="heads", arg_hint="DIR", trees=TREES,
))

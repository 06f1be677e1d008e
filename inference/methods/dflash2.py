"""`dflash2`: a DFlash2 block drafter (built by `specheads.inference.proposers.dflash2`)."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.tree_options import TREES, TreeOptions

METHOD = register_method(Method(
    name="dflash2", summary="a DFlash2 block drafter: one forward fills a block, drafted into a tree token by token "
                            "(each branch's candidates reranked after its own token), prompt lookup grafted on",
    options=TreeOptions, build="specheads.inference.proposers.dflash2:build", arg="heads", arg_hint="DIR",
    trees=TREES,
))

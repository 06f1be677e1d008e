"""Importing this module registers the built-in decoding methods, one declaration module per method."""

from specheads.inference.methods import (  # noqa: F401  (each registers its method)
    ar,
    dflash,
    dflash2,
    domino,
    draft,
    dspark,
    eagle,
    eagle3,
    lookahead,
    medusa,
    ngram,
    peagle,
    suffix,
    xpress,
)

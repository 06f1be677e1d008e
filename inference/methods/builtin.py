"""Importing this module registers the built-in decoding methods, one declaration module per method."""

from specheads.inference.methods import ar, dflash, draft, dspark, eagle, eagle3, medusa, ngram, peagle, suffix  # noqa: F401  (each registers its method)

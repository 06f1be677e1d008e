"""Importing this module registers the built-in formats' exporters and importers, one module per drafter kind."""

from specheads.formats import dflash, dflash2, domino, dspark, eagle, eagle3, medusa, peagle, xpress  # noqa: F401  (each module registers its exporters and importers)

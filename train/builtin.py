"""The built-in training objectives: importing this module registers them (one import per drafter kind)."""

from specheads.train import dflash, dflash2, distill, domino, dspark, eagle, eagle3, medusa, medusa2, peagle, xpress  # noqa: F401  (each module registers its objective)

"""Drafter heads that sit on the frozen target's hidden states, and their shared checkpoint format.

Importing this package registers the built-in drafter kinds (`specheads.kinds.KINDS`): one import per kind.
"""

from specheads.heads import dflash, dflash2, domino, dspark, eagle, eagle3, medusa, peagle, xpress  # noqa: F401  (each module registers its kind)
from specheads.heads.checkpoint import TargetInfo, save_drafter

__all__ = ["TargetInfo", "save_drafter"]

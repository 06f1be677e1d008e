"""Proposers: everything that drafts tokens, behind one `propose` signature.

Importing this package registers the built-in decoding methods (`specheads.inference.methods.METHODS`),
one import per proposer module; each module registers its own method.
"""

from specheads.inference.proposers import base, dflash, draft_model, eagle, eagle3, medusa, ngram, peagle  # noqa: F401  (register methods)
from specheads.inference.proposers.base import AutoregressiveProposer, ProposalContext, Proposer

__all__ = ["AutoregressiveProposer", "ProposalContext", "Proposer"]

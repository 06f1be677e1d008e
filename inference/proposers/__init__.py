"""Proposers: everything that drafts tokens, behind one `propose` signature."""

from specheads.inference.proposers.base import AutoregressiveProposer, ProposalContext, Proposer

__all__ = ["AutoregressiveProposer", "ProposalContext", "Proposer"]

"""Proposers: everything that drafts tokens, behind one `propose` signature.

Each decoding method is declared in `specheads.inference.methods` and built by its proposer module here. The
names below load on first use (PEP 562), so importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specheads.lazy import lazy_attributes

if TYPE_CHECKING:
    from specheads.inference.engine.proposer import AutoregressiveProposer, ProposalContext, Proposer

__all__ = ["AutoregressiveProposer", "ProposalContext", "Proposer"]

__getattr__, __dir__ = lazy_attributes(__name__, dict.fromkeys(__all__, "specheads.inference.engine.proposer"))

"""The speculative-decoding engine: cache, draft tree, proposers, verifier, sampling, engine loop.

The names below load on first use (PEP 562), so importing a light submodule (the command line, whose
`specheads --help` needs no torch) does not import the engine and torch with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specheads.lazy import lazy_attributes

if TYPE_CHECKING:
    from specheads.inference.engine.engine import Engine, GenerationResult
    from specheads.inference.engine.sampling import SamplingParams
    from specheads.inference.engine.stats import GenerationStats
    from specheads.inference.engine.tree import DraftTree
    from specheads.inference.engine.verifier import VerifyResult, verify

_WHERE = {
    "DraftTree": "specheads.inference.engine.tree",
    "Engine": "specheads.inference.engine.engine",
    "GenerationResult": "specheads.inference.engine.engine",
    "GenerationStats": "specheads.inference.engine.stats",
    "SamplingParams": "specheads.inference.engine.sampling",
    "VerifyResult": "specheads.inference.engine.verifier",
    "verify": "specheads.inference.engine.verifier",
}

__all__ = ["DraftTree", "Engine", "GenerationResult", "GenerationStats", "SamplingParams", "VerifyResult", "verify"]

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)

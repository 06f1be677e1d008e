"""The speculative-decoding engine: cache, draft tree, proposers, verifier, sampling, engine loop.

The names below load on first use (PEP 562), so importing a light submodule (the command line, whose
`specheads --help` needs no torch) does not import the engine and torch with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specheads.lazy import lazy_attributes

if TYPE_CHECKING:
    from specheads.inference.engine import Engine, GenerationResult
    from specheads.inference.sampling import SamplingParams
    from specheads.inference.stats import GenerationStats
    from specheads.inference.tree import DraftTree
    from specheads.inference.verifier import VerifyResult, verify

_WHERE = {
    "DraftTree": "tree",
    "Engine": "engine",
    "GenerationResult": "engine",
    "GenerationStats": "stats",
    "SamplingParams": "sampling",
    "VerifyResult": "verifier",
    "verify": "verifier",
}

__all__ = ["DraftTree", "Engine", "GenerationResult", "GenerationStats", "SamplingParams", "VerifyResult", "verify"]

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)

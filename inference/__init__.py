"""The speculative-decoding engine: cache, draft tree, proposers, verifier, sampling, engine loop.

The names below load on first use (PEP 562), so importing a light submodule (the command line, whose
`specheads --help` needs no torch) does not import the engine and torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])

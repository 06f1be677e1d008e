"""The speculative-decoding engine: cache, draft tree, proposers, verifier, sampling, engine loop."""

from specheads.inference.engine import Engine, GenerationResult
from specheads.inference.sampling import SamplingParams
from specheads.inference.stats import GenerationStats
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult, verify

__all__ = [
    "DraftTree",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "VerifyResult",
    "verify",
]

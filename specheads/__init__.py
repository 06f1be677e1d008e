"""specheads: speculative-decoding drafters for a frozen target LLM.

The core package holds what both training (`specheads.train`) and inference
(`specheads.inference`) need: the target adapter and shared configuration.
It imports neither of them.
"""

__version__ = "0.1.0"

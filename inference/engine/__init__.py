"""The engine: KV caches, draft trees, the pure verifier, sampling and the decode loop that joins them.

It depends on no other layer of `specheads.inference`: a proposer reaches it through the `Proposer` protocol
(`proposer.py`) and a serving policy through the `Speculation` protocol (`speculation.py`).
"""

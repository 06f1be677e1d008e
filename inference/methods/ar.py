"""`ar`: plain autoregressive decoding in the engine, the baseline every method is measured against."""

from __future__ import annotations

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import NoOptions

METHOD = register_method(Method(
    name="ar",
    summary="plain autoregressive decoding in the same engine (the baseline speculation is measured against)",
    options=NoOptions, build="specheads.inference.engine.proposer:build_autoregressive",
))

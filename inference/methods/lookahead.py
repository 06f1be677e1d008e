"""`lookahead`: lookahead decoding, its options (built by `specheads.inference.proposers.lookahead`)."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import LookaheadConfig, option


@dataclass(frozen=True)
class LookaheadOptions:
    window: int | None = option(f"W: future positions the Jacobi window guesses in parallel (default "
                                f"{LookaheadConfig.window})")
    ngram: int | None = option(f"N: tokens per n-gram of the pool, >= 3; the window keeps N - 1 levels of guesses "
                               f"(default {LookaheadConfig.ngram})")
    candidates: int | None = option(f"G: n-grams of the pool verified per step (default {LookaheadConfig.candidates})")
    prompt_pool: int | None = option("1: start the pool with the prompt's n-grams (default); 0: only the window's")
    lazy_window: int | None = option("1: run the window only beside pool n-grams expected to pay for the wide "
                                     "forward on this machine (its verify cost, measured once), plain steps "
                                     "otherwise (default); 0: in every step, as lookahead decoding does on a GPU")

    def __post_init__(self) -> None:
        for name in ("prompt_pool", "lazy_window"):
            if getattr(self, name) not in (None, 0, 1):
                raise ValueError(f"--{name.replace('_', '-')} takes 0 or 1, got {getattr(self, name)}")
        self.config()  # a bad value fails before anything loads

    def config(self) -> LookaheadConfig:
        given = {"window": self.window, "ngram": self.ngram, "candidates": self.candidates,
                 "prompt_pool": None if self.prompt_pool is None else bool(self.prompt_pool),
                 "lazy_window": None if self.lazy_window is None else bool(self.lazy_window)}
        return LookaheadConfig(**{k: v for k, v in given.items() if v is not None})


METHOD = register_method(Method(
    name="lookahead", summary="lookahead decoding: a Jacobi window run in the verify forward feeds a pool of n-grams, "
                              "the root's verified in the same forward (no draft model)",
    options=LookaheadOptions, build="specheads.inference.proposers.lookahead:build",
))

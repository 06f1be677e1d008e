"""Sampling parameters and the one logits -> probabilities transform.

Target and draft distributions go through the same `probs` call, so temperature,
top-k and top-p shape both identically before the acceptance test (a requirement
for exact stochastic verification).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}; use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}; use 0 to disable top-k")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_draw(self, question_id: int | str | None, turn: int = 1, sample: int = 0) -> SamplingParams:
        """These parameters with the seed of one draw: derived from (seed, question_id, turn, sample), so every
        question, turn and sample gets its own random stream, the same one run after run and whatever other
        questions are asked. Without a seed, the global RNG already gives independent draws."""
        if self.seed is None:
            return self
        key = json.dumps([self.seed, question_id, turn, sample]).encode()
        return replace(self, seed=int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A seeded generator on `device`, or None (global RNG) when no seed is set."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Turn logits [..., V] into the sampling distribution [..., V] (fp32).

        1. Divide by the temperature (greedy callers use argmax and never reach here).
        2. Keep the top-k logits.
        3. Keep the smallest set of tokens whose probability mass reaches top-p
           (the token that crosses the threshold is kept).
        """
        assert not self.greedy, "greedy decoding uses argmax, not probs()"
        logits = logits.float() / self.temperature
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Mass strictly before each token; drop tokens once the mass before them reaches top_p.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token from each row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])

"""Per-generation statistics, in the glossary's terms (τ counts the bonus token)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # target forwards, the prefill's included (it yields the first token, as step 1)
    draft_steps: int = 0  # steps that verified at least one drafted token
    drafted: int = 0  # draft tokens proposed, over all steps
    accepted: int = 0  # draft tokens accepted, over all steps
    accepted_at_least: list[int] = field(default_factory=list)  # [i]: steps that accepted >= i+1 tokens
    wall_s: float = 0.0
    draft_s: float = 0.0  # time in the proposer (propose and on_verified), within wall_s
    ttft_s: float = 0.0
    finish_reason: str = ""  # "stop" (a stop token), "length" (max_new_tokens), "context" (model's max length), or
    # what the caller's should_stop returned (e.g. "timeout")
    fallbacks: int = 0  # steps decoded plainly because the proposer failed (engines with a fallback handler)

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        if accepted > len(self.accepted_at_least):
            self.accepted_at_least.extend([0] * (accepted - len(self.accepted_at_least)))
        for i in range(accepted):
            self.accepted_at_least[i] += 1

    @property
    def tau(self) -> float:
        """Acceptance length: tokens committed per target forward, accepted + 1, averaged over steps."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        """Share of steps that accepted at least i tokens, for i = 1..deepest acceptance."""
        return [n / self.steps for n in self.accepted_at_least] if self.steps else []

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "draft_steps": self.draft_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accept_per_position": [round(x, 4) for x in self.accept_per_position],
            "wall_s": round(self.wall_s, 4),
            "draft_s": round(self.draft_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s": round(self.ttft_s, 4),
            "finish_reason": self.finish_reason,
            "fallbacks": self.fallbacks,
        }

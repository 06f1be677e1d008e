"""A request's timeline in the server, split into the intervals vLLM's request metrics report.

All times are `time.monotonic()` seconds. A request arrives (the server accepted it), is scheduled (it joined the
engine's batch; its prefill runs in the next step), then each engine step that commits tokens for it is one token
event: the first is the prefill's, every later one a verify step's (one event per step however many tokens it
committed, as vLLM counts inter-token latency under speculative decoding). It finishes when its last step ends.
The intervals are vLLM's:

    queue   = scheduled - arrived           prefill = first token - scheduled
    ttft    = first token - arrived         decode  = last token - first token
    e2e     = finished - arrived            inter-token latencies: the gaps between consecutive token events
    time per output token = decode / (generated tokens - 1), 0 for a one-token answer (the prefill's token is
    not a decode token)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    arrived: float
    scheduled: float | None = None  # None while queued
    token_times: list[float] = field(default_factory=list)  # one per engine step that committed tokens for it
    finished: float | None = None

    @property
    def started(self) -> bool:
        """Whether it produced any token (a request that ended while queued has no intervals but its e2e)."""
        return self.scheduled is not None and bool(self.token_times)

    @property
    def queue_s(self) -> float:
        return self.scheduled - self.arrived

    @property
    def prefill_s(self) -> float:
        return self.token_times[0] - self.scheduled

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrived

    @property
    def decode_s(self) -> float:
        return self.token_times[-1] - self.token_times[0]

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrived

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def time_per_output_token_s(self, generated_tokens: int) -> float:
        return self.decode_s / (generated_tokens - 1) if generated_tokens > 1 else 0.0

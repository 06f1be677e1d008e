"""The server's Prometheus metrics, named after vLLM's (`vllm:` becomes `specheads:`), so dashboards built for
vLLM's speculative decoding read them with a prefix change.

Counters are exposed with Prometheus's `_total` suffix, as vLLM's are. A draft is one verify step that checked at
least one drafted token; `num_accepted_tokens_per_pos{position=i}` counts the drafts that accepted at least i + 1
tokens (so position 0 over num_drafts is the first-token acceptance rate). Each registry is its own, so several
servers (tests) in one process keep separate counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specheads.inference.engine.stats import GenerationStats

PREFIX = "specheads:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels, self._labels = ["model_name"], {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that checked at least one drafted token")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts that accepted at least position + 1 tokens", ("position",))
        self.fallbacks = counter("spec_decode_fallbacks", "Steps decoded plainly because the proposer failed",
                                 ("reason",))
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.running = gauge("num_requests_running", "Requests being decoded")
        self.waiting = gauge("num_requests_waiting", "Requests queued")
        self.enabled = gauge("spec_decode_enabled", "1 while steps at the current batch size may draft "
                             "(speculation on, or adaptive and paying), else 0")
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first generated token")
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the last generated token")

    def labels(self, metric, **extra: str):
        return metric.labels(**self._labels, **extra)

    def record_request(self, stats: GenerationStats, *, queued_s: float) -> None:
        """A finished request's statistics (its steps, tokens and latencies, counting the time it queued)."""
        self.labels(self.num_drafts).inc(stats.draft_steps)
        self.labels(self.num_draft_tokens).inc(stats.drafted)
        self.labels(self.num_accepted_tokens).inc(stats.accepted)
        for position, count in enumerate(stats.accepted_at_least):
            self.labels(self.accepted_per_pos, position=str(position)).inc(count)
        self.labels(self.generation_tokens).inc(stats.new_tokens)
        if stats.steps:
            self.labels(self.ttft).observe(queued_s + stats.ttft_s)
            self.labels(self.e2e).observe(queued_s + stats.wall_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

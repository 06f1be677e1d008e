"""The server's Prometheus metrics, named after vLLM's (`vllm:` becomes `specheads:`), so dashboards built for
vLLM's speculative decoding read them with a prefix change.

Counters are exposed with Prometheus's `_total` suffix, as vLLM's are. A draft is one verify step that checked at
least one drafted token; `num_accepted_tokens_per_pos{position=i}` counts the drafts that accepted at least i + 1
tokens (so position 0 over num_drafts is the first-token acceptance rate). Each registry is its own, so several
servers (tests) in one process keep separate counts.

The request metrics are vLLM's too, with its buckets and labels (`model_name`, and `engine`, always "0": one engine
per server): a finished request's latency split into queue, prefill and decode time (`request_times.py` defines
the intervals), its time to first token, inter-token latencies (one per engine step after the first, however many
tokens the step committed, as vLLM counts them under speculation) and mean time per output token, its prompt and
generated token counts, and `request_success{finished_reason}` with vLLM's reasons: stop, length (max_tokens or the
context), abort (a timeout, a client that left or a shutdown) and error (a failed engine step). Everything about a
request is recorded when it finishes; `prompt_tokens` counts the prompts of requests that were prefilled.
`kv_cache_usage_perc` is the share of the batch's KV capacity in use (`Engine.kv_cache_usage`), 0 to 1 as vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specheads.inference.engine.stats import GenerationStats
from specheads.inference.serve.request_times import RequestTimes

PREFIX = "specheads:"
ENGINE = "0"  # vLLM labels each engine core of a server; ours has one
# vLLM's buckets (v1/metrics/loggers.py), so its dashboards' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
UNKNOWN_CONTEXT = 1 << 20  # the token-count buckets' bound for a model that states no context length
# our finish reasons -> vLLM's finished_reason label values
FINISHED_REASONS = {"stop": "stop", "length": "length", "context": "length", "timeout": "abort",
                    "cancelled": "abort", "shutdown": "abort", "error": "error"}


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets, bounded by the model's context)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels, self._labels = ["model_name", "engine"], {"model_name": model_name, "engine": ENGINE}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets=REQUEST_LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

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
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.request_success = counter("request_success", "Finished requests, by vLLM's finish reason",
                                       ("finished_reason",))
        for reason in sorted(set(FINISHED_REASONS.values())):  # every reason's series exists from the start, as vLLM's
            self.labels(self.request_success, finished_reason=reason)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage: the share of the batch's capacity in use "
                                    "(1 means 100 percent)")
        token_buckets = one_two_five_buckets(max_model_len or UNKNOWN_CONTEXT)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request",
                                                   token_buckets)
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first generated token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive steps that generated tokens for a "
                             "request", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's decode time over its generated "
                              "tokens after the first", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the end of the request")
        self.queue_time = histogram("request_queue_time_seconds", "From arrival to joining the batch")
        self.prefill_time = histogram("request_prefill_time_seconds", "From joining the batch to the first token")
        self.decode_time = histogram("request_decode_time_seconds", "From the first token to the last")

    def labels(self, metric, **extra: str):
        return metric.labels(**self._labels, **extra)

    def record_request(self, stats: GenerationStats, times: RequestTimes, *, prompt_tokens: int) -> None:
        """A finished request's statistics (its steps and tokens) and timeline. One that ended before its first
        token (timed out or abandoned while queued) counts in `request_success` only, so every histogram counts the
        same requests: those that ran."""
        self.labels(self.request_success, finished_reason=FINISHED_REASONS.get(stats.finish_reason, "abort")).inc()
        if not times.started:
            return
        self.labels(self.e2e).observe(times.e2e_s)
        self.labels(self.num_drafts).inc(stats.draft_steps)
        self.labels(self.num_draft_tokens).inc(stats.drafted)
        self.labels(self.num_accepted_tokens).inc(stats.accepted)
        for position, count in enumerate(stats.accepted_at_least):
            self.labels(self.accepted_per_pos, position=str(position)).inc(count)
        self.labels(self.generation_tokens).inc(stats.new_tokens)
        self.labels(self.prompt_tokens).inc(prompt_tokens)
        self.labels(self.request_prompt_tokens).observe(prompt_tokens)
        self.labels(self.request_generation_tokens).observe(stats.new_tokens)
        self.labels(self.ttft).observe(times.ttft_s)
        for gap in times.inter_token_s:
            self.labels(self.itl).observe(gap)
        self.labels(self.tpot).observe(times.time_per_output_token_s(stats.new_tokens))
        self.labels(self.queue_time).observe(times.queue_s)
        self.labels(self.prefill_time).observe(times.prefill_s)
        self.labels(self.decode_time).observe(times.decode_s)

    def record_error(self) -> None:
        """A request that a failed engine step ended (its client got an error)."""
        self.labels(self.request_success, finished_reason="error").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""vLLM's request metrics on /metrics and per-request acceptance in `usage`, through a real server.

/metrics is scraped before and after real requests and parsed with prometheus_client's own parser: every family's
counts and sums must match what the requests did (token counts, number of requests, finish reasons, the engine steps
behind the inter-token latencies), the intervals must add up, and the buckets and labels must be vLLM's. The
per-request report must equal the engine's own statistics for that request (the `GenerationStats` the service
finished it with), and appear only when asked for.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.serve.server import ServerSettings
from tests.conftest import repetitive_prompt
from tests.inference.serve.live_server import MODEL, LiveServer, Slow, wait_for

openai = pytest.importorskip("openai")

# vLLM's buckets (v1/metrics/loggers.py), written out here so a change on our side shows
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200]  # 1-2-5 up to the tiny model's context of 256
BUCKETS = {"time_to_first_token_seconds": TTFT, "inter_token_latency_seconds": PER_TOKEN,
           "request_time_per_output_token_seconds": PER_TOKEN, "e2e_request_latency_seconds": REQUEST,
           "request_queue_time_seconds": REQUEST, "request_prefill_time_seconds": REQUEST,
           "request_decode_time_seconds": REQUEST, "request_prompt_tokens": TOKENS, "request_generation_tokens": TOKENS}
PER_REQUEST = [name for name in BUCKETS if name != "inter_token_latency_seconds"]  # one observation per request


def ngram(target):
    return make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None)


class Served(LiveServer):
    """A server that keeps the engine's statistics of every request it finished, by response id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stats: dict[str, GenerationStats] = {}
        finished = self.service._finished

        def keep(job, stats: GenerationStats) -> None:
            self.stats[job.request_id] = stats
            finished(job, stats)

        self.service._finished = keep


@pytest.fixture(scope="module")
def server(target, tokenizer):
    live = Served(Engine(target, ngram(target), max_rows=4), tokenizer, max_tokens=64)
    yield live
    live.close()


@pytest.fixture
def fresh(target, tokenizer):
    """A server of its own, so its n-gram proposer's state (its acceptance estimates) depends on this test alone."""
    live = Served(Engine(target, ngram(target), max_rows=4), tokenizer, max_tokens=64)
    yield live
    live.close()


def prompt_text(seed: int, length: int = 32) -> str:
    return " ".join(f"w{t}" for t in repetitive_prompt(length, seed))


def scrape(live: LiveServer) -> dict[tuple[str, tuple], float]:
    """Every specheads sample: (name without the prefix, sorted labels) -> value."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(live.url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith("specheads:"):
                samples[(s.name.removeprefix("specheads:"), tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))), 0.0)


def check_report(report: dict, stats: GenerationStats, detailed: bool) -> None:
    assert stats.draft_steps > 0 and stats.accepted > 0  # n-gram lookup drafted and hit on these prompts
    assert report["num_steps"] == stats.steps
    assert report["num_spec_steps"] == stats.draft_steps
    assert report["num_draft_tokens"] == stats.drafted
    assert report["num_accepted_draft_tokens"] == stats.accepted
    assert report["mean_acceptance_length"] == pytest.approx(1 + stats.accepted / stats.draft_steps)  # vLLM's
    assert report["tau"] == pytest.approx(stats.tau) == (stats.accepted + stats.steps) / stats.steps
    assert report["draft_acceptance_rate"] == pytest.approx(stats.accepted / stats.drafted)
    histogram = report["acceptance_histogram"]
    assert sum(histogram) == stats.draft_steps
    assert sum(j * n for j, n in enumerate(histogram)) == stats.accepted
    assert len(histogram) == len(stats.accepted_at_least) + 1
    if detailed:
        assert report["num_accepted_tokens_per_pos"] == stats.accepted_at_least
        assert report["acceptance_rate_per_position"] == pytest.approx(
            [n / stats.draft_steps for n in stats.accepted_at_least])
    else:
        assert "num_accepted_tokens_per_pos" not in report and "acceptance_rate_per_position" not in report


# --- /metrics -------------------------------------------------------------------------------------------------------


def test_request_metrics_account_for_every_request(server):
    client = server.client()
    before = scrape(server)
    outs = [client.completions.create(model=MODEL, prompt=prompt_text(seed), max_tokens=n, temperature=0,
                                      extra_body={"spec_decode_metrics": True})
            for seed, n in ((1, 40), (2, 6), (3, 64))]
    words = outs[0].choices[0].text.split()
    assert len(words) > 8
    stop_out = client.completions.create(model=MODEL, prompt=prompt_text(1), max_tokens=40, temperature=0,
                                         stop=[" ".join(words[6:8])], extra_body={"spec_decode_metrics": True})
    assert stop_out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt_text(5)}],
                                          max_tokens=24, temperature=0, extra_body={"spec_decode_metrics": True})
    after = scrape(server)
    delta = {key: v - before.get(key, 0.0) for key, v in after.items()}

    def d(name: str, **labels: str) -> float:
        return value(delta, name, **labels)

    usages = [o.usage for o in (*outs, stop_out, chat)]
    reasons = [o.choices[0].finish_reason for o in (*outs, stop_out, chat)]
    n = len(usages)
    assert "length" in reasons  # the 6-token answer at least
    for reason in ("stop", "length", "abort", "error"):
        assert d("request_success_total", finished_reason=reason) == reasons.count(reason), reason
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert d("prompt_tokens_total") == prompt_tokens == d("request_prompt_tokens_sum")
    assert d("generation_tokens_total") == generated == d("request_generation_tokens_sum")
    for name in PER_REQUEST:
        assert d(name + "_count") == n, name  # one observation per request
        assert d(name + "_bucket", le="+Inf") == n, name
    # one inter-token latency per engine step after the prefill, however many tokens the step committed
    steps = [u.spec_decode_metrics["num_steps"] for u in usages]
    assert d("inter_token_latency_seconds_count") == sum(s - 1 for s in steps)
    assert sum(steps) < generated  # speculation committed several tokens in some steps

    ttft, queue, prefill = (d(f"{x}_sum") for x in ("time_to_first_token_seconds", "request_queue_time_seconds",
                                                     "request_prefill_time_seconds"))
    decode, itl, e2e = (d(f"{x}_sum") for x in ("request_decode_time_seconds", "inter_token_latency_seconds",
                                                "e2e_request_latency_seconds"))
    assert ttft == pytest.approx(queue + prefill, abs=1e-6) and prefill > 0
    assert itl == pytest.approx(decode, abs=1e-6) and decode > 0
    assert e2e >= ttft + decode - 1e-6
    tpot = d("request_time_per_output_token_seconds_sum")
    assert 0 < tpot <= decode  # each request's decode time over (its tokens - 1)
    assert value(after, "kv_cache_usage_perc") == 0.0  # every row is free again
    assert value(after, "num_requests_running") == 0


def test_metrics_have_vllms_buckets_and_labels(server):
    server.client().completions.create(model=MODEL, prompt=prompt_text(6), max_tokens=8, temperature=0)
    samples = scrape(server)
    for name, bounds in BUCKETS.items():
        les = sorted(float(dict(labels)["le"]) for (n, labels) in samples if n == name + "_bucket")
        assert les == [*map(float, bounds), float("inf")], name
    assert all(dict(labels).get("model_name") == MODEL and dict(labels).get("engine") == "0"
               for (_, labels) in samples), "every series carries vLLM's model_name and engine labels"
    names = {n for n, _ in samples}
    assert "time_per_output_token_seconds_count" not in names  # vLLM dropped it for inter_token_latency_seconds
    for reason in ("stop", "length", "abort", "error"):  # every reason's series exists, as vLLM's
        assert ("request_success_total", tuple(sorted({"model_name": MODEL, "engine": "0",
                                                        "finished_reason": reason}.items()))) in samples


def test_kv_cache_usage_aborts_and_errors(target, tokenizer):
    gate = threading.Event()
    live = LiveServer(Engine(target, Slow(gate=gate), max_rows=2), tokenizer, stops=[], max_tokens=1000,
                      request_timeout_s=2.0)
    ids = list(tokenizer(prompt_text(7))["input_ids"])
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, live.url + "/v1/completions", timeout=60,
                               json={"prompt": prompt_text(7), "max_tokens": 4, "temperature": 0})
            wait_for(lambda: live.metric("num_requests_running") == 1)
            wait_for(lambda: live.metric("kv_cache_usage_perc") > 0)
            # prefilled, its second step waits at the gate: the prompt's entries of 2 rows x 256 positions
            assert live.metric("kv_cache_usage_perc") == pytest.approx(len(ids) / (2 * 256))
            gate.set()
            assert held.result().status_code == 200
        assert live.metric("kv_cache_usage_perc") == 0.0
        assert live.metric("request_success_total", finished_reason="length") == 1

        live.service.engine.proposer.delay = 0.1  # past its 2 s deadline after ~20 steps
        out = live.client().completions.create(model=MODEL, prompt=prompt_text(8), max_tokens=1000, temperature=0)
        assert out.choices[0].finish_reason == "timeout"
        assert live.metric("request_success_total", finished_reason="abort") == 1

        engine, step = live.service.engine, live.service.engine.step
        engine.step = lambda: (setattr(engine, "step", step), 1 / 0)[1]  # the next step fails, once
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "w3 w4", "max_tokens": 2}).status_code == 500
        assert live.metric("request_success_total", finished_reason="error") == 1
        # the error has no timeline: the histograms count the two requests that ran
        assert live.metric("e2e_request_latency_seconds_count") == 2
        assert live.metric("request_prompt_tokens_count") == 2
    finally:
        gate.set()
        live.close()


# --- per-request acceptance -----------------------------------------------------------------------------------------


def test_acceptance_in_usage_equals_the_engines_stats_when_asked(fresh):
    client = fresh.client()
    prompt = prompt_text(14, 40)
    asked = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={"spec_decode_metrics": True})
    stats = fresh.stats[asked.id]
    assert asked.usage.completion_tokens == stats.new_tokens
    check_report(asked.usage.spec_decode_metrics, stats, detailed=False)

    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
    assert plain.choices[0].text == asked.choices[0].text and plain.id in fresh.stats
    assert "spec_decode_metrics" not in (plain.usage.model_extra or {})  # only when asked

    messages = [{"role": "user", "content": prompt_text(13, 40)}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          extra_body={"spec_decode_metrics": "detailed"})
    check_report(chat.usage.spec_decode_metrics, fresh.stats[chat.id], detailed=True)


def test_a_stream_carries_the_acceptance_in_its_final_usage_chunk(fresh):
    messages = [{"role": "user", "content": prompt_text(13, 40)}]

    def stream(path: str = "/v1/chat/completions", **extra) -> list[dict]:
        body = {"max_tokens": 40, "temperature": 0, "stream": True, **extra}
        body |= {"messages": messages} if path.endswith("chat/completions") else {"prompt": prompt_text(14, 40)}
        with httpx.stream("POST", fresh.url + path, json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[6:]) for e in events[:-1]]

    chunks = stream(spec_decode_metrics=True)  # asking for the metrics sends the usage chunk
    assert chunks[-1]["choices"] == [] and all("usage" not in c for c in chunks[:-1])
    check_report(chunks[-1]["usage"]["spec_decode_metrics"], fresh.stats[chunks[-1]["id"]], detailed=False)
    usage_only = stream(stream_options={"include_usage": True})
    assert "spec_decode_metrics" not in usage_only[-1]["usage"]
    assert all("usage" not in c for c in stream())

    chunks = stream("/v1/completions", spec_decode_metrics="detailed")
    check_report(chunks[-1]["usage"]["spec_decode_metrics"], fresh.stats[chunks[-1]["id"]], detailed=True)


def test_a_server_level_reports_every_request_and_logs_each_at_debug(target, tokenizer, caplog):
    live = Served(Engine(target, ngram(target)), tokenizer, spec_decode_metrics="detailed", max_tokens=64)
    try:
        client = live.client()
        prompt = prompt_text(5, 40)
        with caplog.at_level(logging.DEBUG, logger="specheads.inference.serve.service"):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
            off = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                            extra_body={"spec_decode_metrics": False})
        check_report(out.usage.spec_decode_metrics, live.stats[out.id], detailed=True)
        assert "spec_decode_metrics" not in (off.usage.model_extra or {})
        lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records
                 if "mean acceptance length" in r.getMessage()}
        assert set(lines) == {out.id, off.id}  # one line per request, asked or not
        for rid, line in lines.items():
            stats = live.stats[rid]
            assert (f"mean acceptance length {1 + stats.accepted / stats.draft_steps:.3f}, tau {stats.tau:.3f}"
                    in line), line
    finally:
        live.close()


def test_bad_levels_get_one_clear_error(server):
    with pytest.raises(ValueError, match="must be one of summary, detailed"):
        ServerSettings(MODEL, spec_decode_metrics="full")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "w3", "spec_decode_metrics": "full"})
    assert r.status_code == 400 and "spec_decode_metrics" in r.json()["error"]["message"]

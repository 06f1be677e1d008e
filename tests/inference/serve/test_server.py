"""`specheads serve`: a real server on a loopback port, driven by the official `openai` client and raw HTTP; the
shared server decodes up to 4 requests per step.

Greedy answers must equal the target's own greedy continuation (computed here with `ar` in the engine); a proposer
that raises or returns a malformed tree must cost speculation, never the request; timeouts, disconnects, a full
queue, a missing API key and every kind of bad input get their own answer without disturbing requests in flight.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods import METHODS, make_proposer
from specheads.target import render_messages
from tests.conftest import repetitive_prompt
from tests.inference.serve.live_server import MODEL, STOPS, LiveServer, Slow, wait_for

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")



def prompt_text(seed: int, length: int = 24) -> str:
    return " ".join(f"w{t}" for t in repetitive_prompt(length, seed))


def greedy_reference(target, ids: list[int], max_new_tokens: int) -> list[int]:
    return Engine(target, AutoregressiveProposer()).generate(
        ids, max_new_tokens=max_new_tokens, stop_token_ids=STOPS).output_ids


def ngram(target):
    return make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None)


@pytest.fixture(scope="module")
def server(target, tokenizer):
    live = LiveServer(Engine(target, ngram(target), max_rows=4), tokenizer, max_tokens=64)  # batches of up to 4
    yield live
    live.close()


# --- the API, through the official client --------------------------------------------------------------------------


def test_completions_and_chat_return_the_targets_greedy_answer(server, target, tokenizer):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = prompt_text(1)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    ids = list(tokenizer(prompt)["input_ids"])
    want = greedy_reference(target, ids, 40)
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert out.choices[0].finish_reason == ("stop" if want[-1] in STOPS else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text

    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": prompt_text(2)}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    want = greedy_reference(target, render_messages(tokenizer, messages), 32)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert chat.usage.completion_tokens == len(want)


def test_streams_send_the_same_answer_in_pieces_and_end_with_done(server, target, tokenizer):
    client = server.client()
    messages = [{"role": "user", "content": prompt_text(3)}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed as it was generated, not in one piece
    assert "".join(pieces) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": prompt_text(4), "max_tokens": 16,
                                                                     "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    ids = list(tokenizer(prompt_text(4))["input_ids"])
    assert text == tokenizer.decode(greedy_reference(target, ids, 16), skip_special_tokens=True)


def test_stop_strings_end_the_answer_before_them(server, target, tokenizer):
    ids = list(tokenizer(prompt_text(5))["input_ids"])
    full = tokenizer.decode(greedy_reference(target, ids, 40), skip_special_tokens=True)
    words = full.split()
    assert len(words) > 6, full
    stop = " ".join(words[4:6])  # two words, so the stop string spans tokens
    out = server.client().completions.create(model=MODEL, prompt=prompt_text(5), max_tokens=40, temperature=0,
                                             stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_metrics_count_drafts_accepted_tokens_and_requests(server):
    before = {name: server.metric(name) for name in ("generation_tokens_total", "spec_decode_num_drafts_total",
                                                     "spec_decode_num_draft_tokens_total",
                                                     "spec_decode_num_accepted_tokens_total")}
    first_pos = server.metric("spec_decode_num_accepted_tokens_per_pos_total", position="0")
    outs = [server.client().completions.create(model=MODEL, prompt=prompt_text(seed, 40), max_tokens=48,
                                               temperature=0) for seed in (6, 7)]
    delta = {name: server.metric(name) - value for name, value in before.items()}
    assert delta["generation_tokens_total"] == sum(o.usage.completion_tokens for o in outs)
    assert delta["spec_decode_num_drafts_total"] > 0  # n-gram lookup drafted on these repetitive prompts
    assert delta["spec_decode_num_draft_tokens_total"] >= delta["spec_decode_num_drafts_total"]
    accepted = delta["spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= delta["spec_decode_num_draft_tokens_total"]
    first = server.metric("spec_decode_num_accepted_tokens_per_pos_total", position="0") - first_pos
    assert 0 < first <= delta["spec_decode_num_drafts_total"]  # drafts whose first token was accepted
    assert server.metric("spec_decode_enabled") == 1
    assert server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0
    assert server.metric("e2e_request_latency_seconds_count") >= 2
    assert server.metric("time_to_first_token_seconds_count") >= 2


def test_concurrent_clients_all_get_their_own_greedy_answer(server, target, tokenizer):
    prompts = [prompt_text(seed, 8 + 3 * (seed % 5)) for seed in range(12)]  # mixed lengths
    want = {p: tokenizer.decode(greedy_reference(target, list(tokenizer(p)["input_ids"]), 12),
                                skip_special_tokens=True) for p in prompts}

    def client_session(k: int) -> list[tuple[str, str]]:
        client = server.client()
        return [(p, client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text)
                for p in (prompts[(k + j) % len(prompts)] for j in range(4))]

    steps = server.metric("spec_decode_num_drafts_total")
    seen_running: list[float] = []
    with ThreadPoolExecutor(13) as pool:
        load = pool.map(client_session, range(12))
        watch = pool.submit(lambda: [seen_running.append(server.metric("num_requests_running")) or time.sleep(0.01)
                                     for _ in range(100)])
        answers = [a for session in load for a in session]
        watch.result()
    assert max(seen_running) > 1  # requests were decoded together, in one batch
    assert len(answers) == 48
    assert all(text == want[p] for p, text in answers)
    assert server.metric("spec_decode_num_drafts_total") > steps


def test_seeded_sampling_is_reproducible(server):
    client = server.client()
    draws = [client.completions.create(model=MODEL, prompt=prompt_text(8), max_tokens=16, temperature=1.0,
                                       seed=11).choices[0].text for _ in range(2)]
    assert draws[0] == draws[1]


def test_requests_to_one_server_share_the_suffix_cache(target, tokenizer):
    """Suffix decoding's cache of answers lives with the engine: a request drafts a finished one's answer, whichever
    row either was decoded in."""
    proposer = make_proposer("suffix", target, METHODS.get("suffix").make_options({"node_budget": "fixed"}), None)
    live = LiveServer(Engine(target, proposer, max_rows=2), tokenizer, stops=[], max_tokens=64)  # 40 tokens each

    def reference(prompt: str, max_new_tokens: int) -> str:
        ids = list(tokenizer(prompt)["input_ids"])
        return tokenizer.decode(Engine(target, AutoregressiveProposer()).generate(
            ids, max_new_tokens=max_new_tokens).output_ids, skip_special_tokens=True)

    try:
        client, prompt = live.client(), prompt_text(13)
        want = reference(prompt, 40)
        accepted = []
        for _ in range(2):
            before = live.metric("spec_decode_num_accepted_tokens_total")
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
            assert out.choices[0].text == want and out.usage.completion_tokens == 40
            accepted.append(live.metric("spec_decode_num_accepted_tokens_total") - before)
        assert len(proposer.cache) == 2  # both answers, held by the engine's one cache
        assert accepted[1] >= 30 and accepted[1] > accepted[0], accepted  # the repeat drafted the first answer

        with ThreadPoolExecutor(2) as pool:  # two rows at once: each a fork, all sharing the cache
            texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=16,
                                                                      temperature=0).choices[0].text,
                                  [prompt_text(14), prompt_text(15)]))
        assert texts == [reference(p, 16) for p in (prompt_text(14), prompt_text(15))]
        assert len(proposer.cache) == 4
    finally:
        live.close()


# --- failures that must not cost the request ------------------------------------------------------------------------


class Flaky:
    """n-gram lookup that raises on every other step and returns a tree with the wrong root on every third."""

    def __init__(self, inner) -> None:
        self.inner, self.needs_target_hidden, self.calls = inner, inner.needs_target_hidden, 0

    def start(self, ctx, hidden):
        self.inner.start(ctx, hidden)

    def on_verified(self, result, hidden):
        self.inner.on_verified(result, hidden)

    def propose(self, ctx):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("drafter crashed")
        if self.calls % 3 == 0:
            return DraftTree.chain(torch.tensor([int(ctx.tokens[-1]) + 1, 5]))
        return self.inner.propose(ctx)


def test_a_failing_proposer_falls_back_to_plain_steps_and_the_request_completes(target, tokenizer, caplog):
    live = LiveServer(Engine(target, Flaky(ngram(target))), tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger="specheads.inference.serve.service"):
            for seed in (9, 10):
                out = live.client().completions.create(model=MODEL, prompt=prompt_text(seed), max_tokens=30,
                                                       temperature=0)
                ids = list(tokenizer(prompt_text(seed))["input_ids"])
                assert out.choices[0].text == tokenizer.decode(greedy_reference(target, ids, 30),
                                                               skip_special_tokens=True)
        assert live.metric("spec_decode_fallbacks_total", reason="proposer_error") > 1
        assert live.metric("spec_decode_fallbacks_total", reason="malformed_tree") > 1
        logged = [r.getMessage() for r in caplog.records if "fell back" in r.getMessage()]
        assert len(logged) == 2  # once per reason, however often it happened
        assert any("proposer_error" in m and "drafter crashed" in m for m in logged)
        assert any("malformed_tree" in m and "root" in m for m in logged)
    finally:
        live.close()


class FailsToStart(Flaky):
    def start(self, ctx, hidden):
        raise RuntimeError("drafter could not start")


def test_a_proposer_that_fails_to_start_and_a_failed_step_cost_no_other_request(target, tokenizer):
    live = LiveServer(Engine(target, FailsToStart(ngram(target))), tokenizer)
    try:
        ids = list(tokenizer(prompt_text(16))["input_ids"])
        want = tokenizer.decode(greedy_reference(target, ids, 20), skip_special_tokens=True)
        body = {"prompt": prompt_text(16), "max_tokens": 20, "temperature": 0}
        assert httpx.post(live.url + "/v1/completions", json=body).json()["choices"][0]["text"] == want
        assert live.metric("spec_decode_fallbacks_total", reason="proposer_error") >= 1

        engine, step = live.service.engine, live.service.engine.step
        engine.step = lambda: (setattr(engine, "step", step), 1 / 0)[1]  # the next step fails, once
        failed = httpx.post(live.url + "/v1/completions", json=body)
        assert failed.status_code == 500 and "division by zero" in failed.json()["error"]["message"]
        assert httpx.post(live.url + "/v1/completions", json=body).json()["choices"][0]["text"] == want
        assert live.metric("num_requests_running") == 0
    finally:
        live.close()


def test_a_request_past_its_timeout_ends_with_finish_reason_timeout(target, tokenizer):
    # no stop tokens: only the deadline can end it early
    live = LiveServer(Engine(target, Slow(delay=0.05)), tokenizer, stops=[], request_timeout_s=0.5, max_tokens=1000)
    try:
        out = live.client().completions.create(model=MODEL, prompt=prompt_text(11), max_tokens=1000, temperature=0)
        assert out.choices[0].finish_reason == "timeout"
        assert 1 <= out.usage.completion_tokens < 100
        assert live.metric("num_requests_running") == 0  # its slot is free
    finally:
        live.close()


def test_a_client_that_leaves_mid_stream_cancels_its_request(target, tokenizer):
    slow = Slow(delay=0.05)
    live = LiveServer(Engine(target, slow), tokenizer, stops=[], max_tokens=1000)
    try:
        with httpx.stream("POST", live.url + "/v1/completions", json={"prompt": prompt_text(12), "max_tokens": 1000,
                                                                      "temperature": 0, "stream": True}) as r:
            next(r.iter_lines())  # the first piece arrived: the request is running
        deadline = time.monotonic() + 10
        while live.metric("num_requests_running") > 0:
            assert time.monotonic() < deadline, "the abandoned request kept running"
            time.sleep(0.05)
        steps = slow.steps
        assert steps < 150  # ended well before its 1000 tokens
        time.sleep(0.3)
        assert slow.steps == steps  # and decodes no more
    finally:
        live.close()


def test_a_full_queue_answers_429_and_the_queued_requests_complete(target, tokenizer):
    gate = threading.Event()
    live = LiveServer(Engine(target, Slow(gate=gate)), tokenizer, max_queue=1)
    body = {"prompt": prompt_text(13), "max_tokens": 4, "temperature": 0}
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60)
            wait_for(lambda: live.metric("num_requests_running") == 1)
            queued = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60)
            wait_for(lambda: live.metric("num_requests_waiting") == 1)
            full = httpx.post(live.url + "/v1/completions", json=body)
            assert full.status_code == 429 and "holds 2 requests already" in full.json()["error"]["message"]
            gate.set()
            assert running.result().status_code == 200 and queued.result().status_code == 200
            assert running.result().json()["choices"][0]["text"] == queued.result().json()["choices"][0]["text"]
    finally:
        gate.set()
        live.close()


def test_an_api_key_is_required_on_v1_when_set(target, tokenizer):
    live = LiveServer(Engine(target, AutoregressiveProposer()), tokenizer, api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "w3"}).status_code == 401
        assert live.client(api_key="sekret").completions.create(model=MODEL, prompt="w3 w4", max_tokens=2).usage
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # probes need no key
    finally:
        live.close()


# --- bad input ------------------------------------------------------------------------------------------------------


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages is required"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt is required"),
    ("/v1/completions", {"prompt": "w3", "max_tokens": 0}, 400, r"max_tokens must be in \[1, 64\]"),
    ("/v1/completions", {"prompt": "w3", "max_tokens": 65}, 400, r"max_tokens must be in \[1, 64\]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}], "temperature": -1}, 400,
     "temperature must be >= 0"),
    ("/v1/completions", {"prompt": "w3", "top_p": 0}, 400, r"top_p must be in \(0, 1\]"),
    ("/v1/completions", {"prompt": "w3", "top_p": 1.5}, 400, r"top_p must be in \(0, 1\]"),
    ("/v1/completions", {"prompt": "w3", "model": "gpt-4"}, 400, "unknown model 'gpt-4'; this server serves 'tiny'"),
    ("/v1/completions", {"prompt": [5] * 300}, 400, "the prompt has 300 tokens, but this model's context holds 256"),
    ("/v1/completions", {"prompt": "w3 " * 2000}, 413, "over the server's limit of 4096 bytes"),
    ("/v1/completions", {"prompt": "w3", "n": 2}, 400, "n=2 is not supported: one answer per request"),
    ("/v1/completions", {"prompt": "w3", "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5 is not supported"),
]


def send(server: LiveServer, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD)
def test_bad_input_gets_one_clear_error(server, path, body, status, message):
    r = send(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and re.search(message, error["message"]), error["message"]


def test_bad_input_does_not_disturb_a_request_in_flight(target, tokenizer):
    gate = threading.Event()  # holds the request mid-generation while the bad ones arrive
    live = LiveServer(Engine(target, Slow(gate=gate)), tokenizer, max_tokens=64)
    prompt = prompt_text(14, 40)
    try:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, live.url + "/v1/completions",
                                    json={"prompt": prompt, "max_tokens": 48, "temperature": 0}, timeout=60)
            wait_for(lambda: live.metric("num_requests_running") == 1)
            assert [send(live, path, body).status_code for path, body, _, _ in BAD] == [s for _, _, s, _ in BAD]
            gate.set()
            ids = list(tokenizer(prompt)["input_ids"])
            assert in_flight.result().json()["choices"][0]["text"] == tokenizer.decode(
                greedy_reference(target, ids, 48), skip_special_tokens=True)
    finally:
        gate.set()
        live.close()


def test_sampling_params_reach_the_engine_unchanged():
    from specheads.inference.serve.server import CompletionRequest, _sampling

    body = CompletionRequest(prompt="w3", temperature=0.7, top_p=0.9, top_k=5, seed=3)
    assert _sampling(body) == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3)


def test_the_serve_command_serves_a_saved_target(tiny_model_dir, target, tokenizer):
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specheads.inference.cli", "serve", "--target", str(tiny_model_dir),
                             "--method", "ngram", "--port", str(port), "--api-key", "k", "--max-tokens", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "specheads serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [str(tiny_model_dir)]
        out = client.completions.create(model=str(tiny_model_dir), prompt=prompt_text(15), max_tokens=20, temperature=0)
        ids = list(tokenizer(prompt_text(15))["input_ids"])
        # the saved target is the fixture's model (same seed), its eos the tokenizer's </s> (id 2)
        assert out.choices[0].text == tokenizer.decode(greedy_reference(target, ids, 20), skip_special_tokens=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""Admission and shutdown: the server holds up to --max-batch + --max-queue requests, and on SIGTERM it drains:
running requests are answered (complete, or ended with finish_reason "shutdown" when the grace period ends), waiting
ones get an error body, new ones 503 while `/health` fails, and the process exits within the grace period. Nothing
admitted goes unanswered.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from tests.inference.serve.live_server import STOPS, LiveServer, Slow, wait_for

ROOT = Path(__file__).resolve().parents[3]
GRACE_S = 3.0
LONG = "w100 w90 w80"  # its greedy answer runs past 200 tokens: no stop token ends it early


def greedy_text(target, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = list(tokenizer(prompt)["input_ids"])
    out = Engine(target, AutoregressiveProposer()).generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=STOPS)
    return tokenizer.decode(out.output_ids, skip_special_tokens=True)


def test_the_server_admits_up_to_its_rows_plus_its_queue_and_refuses_the_rest(target, tokenizer):
    gate = threading.Event()  # holds the first step, so that every request arrives while it runs
    live = LiveServer(Engine(target, Slow(gate=gate), max_rows=2), tokenizer, max_queue=2)
    body = {"prompt": "w3 w4 w5", "max_tokens": 3, "temperature": 0}
    try:
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60)
            wait_for(lambda: live.metric("num_requests_running") == 1)
            rest = [pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60) for _ in range(5)]
            wait_for(lambda: sum(f.done() for f in rest) == 2)  # two refused at once, three held
            refused = [f.result() for f in rest if f.done()]
            assert [r.status_code for r in refused] == [429, 429]
            assert "holds 4 requests already (2 decoding, 2 waiting)" in refused[0].json()["error"]["message"]
            gate.set()
            answers = [first.result()] + [f.result() for f in rest if f.result().status_code != 429]
        assert [r.status_code for r in answers] == [200] * 4
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    finally:
        gate.set()
        live.close()


class SlowServer:
    """`tests/inference/serve/slow_serve.py` in its own process on a free loopback port."""

    def __init__(self, **flags) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.inference.serve.slow_serve",
                                      f"--port={self.port}", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while not self._healthy():
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(f"specheads:{name}{{"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=30)[0]


def stream_events(url: str, body: dict) -> tuple[int, list]:
    """The status and the events (parsed JSON, or "[DONE]") of a streamed request."""
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def test_sigterm_drains_running_requests_refuses_waiting_and_new_ones_and_exits_in_time(target, tokenizer):
    server = SlowServer(delay=0.05, max_batch=2, max_queue=4, shutdown_timeout=GRACE_S)
    prompt_long, prompt_short = LONG, "w11 w12 w13"
    # the references first: computed after the signal, they would count in the time the server takes to exit
    chat_prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt_short}],
                                                add_generation_prompt=True, tokenize=False)
    want_short, want_long = greedy_text(target, tokenizer, chat_prompt, 8), greedy_text(target, tokenizer,
                                                                                          prompt_long, 200)
    try:
        with ThreadPoolExecutor(4) as pool:
            # running: one far longer than the grace period, one that ends well inside it (streamed)
            long = pool.submit(httpx.post, server.url + "/v1/completions",
                               json={"prompt": prompt_long, "max_tokens": 200, "temperature": 0}, timeout=60)
            short = pool.submit(stream_events, server.url + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": prompt_short}], "max_tokens": 8,
                                 "temperature": 0})
            wait_for(lambda: server.metric("num_requests_running") == 2)
            # waiting: one plain, one streamed
            waiting = pool.submit(httpx.post, server.url + "/v1/completions",
                                  json={"prompt": "w3", "max_tokens": 4}, timeout=60)
            waiting_stream = pool.submit(stream_events, server.url + "/v1/completions",
                                         {"prompt": "w3", "max_tokens": 4})
            wait_for(lambda: server.metric("num_requests_waiting") == 2)

            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(server.url + "/health").status_code == 503)
            late = httpx.post(server.url + "/v1/completions", json={"prompt": "w3", "max_tokens": 2})
            assert late.status_code == 503
            assert late.json()["error"]["type"] == "server_error" and "shutting down" in late.json()["error"]["message"]

            refused = waiting.result()
            assert refused.status_code == 503 and "did not start" in refused.json()["error"]["message"]
            status, events = waiting_stream.result()
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events

            status, events = short.result()
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"  # completed within the grace period
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
            assert text == want_short

            cut = long.result()
            assert cut.status_code == 200, cut.text
            choice = cut.json()["choices"][0]
            assert choice["finish_reason"] == "shutdown"  # still running when the grace period ended
            assert 0 < cut.json()["usage"]["completion_tokens"] < 200
            assert want_long.startswith(choice["text"])  # exact to there

        assert server.proc.wait(timeout=GRACE_S + 10) == 0
        took = time.monotonic() - signalled
        assert GRACE_S - 0.5 < took < GRACE_S + 5, took  # the long request held it to the grace period, no longer
        log = server.stop()
        assert "shutting down: 2 running requests" in log, log
    finally:
        server.stop()


def test_sigterm_on_an_idle_server_exits_at_once_and_a_second_signal_stops_a_draining_one():
    idle = SlowServer(shutdown_timeout=30)
    try:
        idle.proc.send_signal(signal.SIGTERM)
        assert idle.proc.wait(timeout=10) == 0
    finally:
        idle.stop()

    busy = SlowServer(delay=0.05, max_batch=1, shutdown_timeout=30)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, busy.url + "/v1/completions",
                                  json={"prompt": LONG, "max_tokens": 200, "temperature": 0}, timeout=60)
            wait_for(lambda: busy.metric("num_requests_running") == 1)
            busy.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(busy.url + "/health").status_code == 503)
            busy.proc.send_signal(signal.SIGINT)  # the second signal: stop now, not in 30 s
            answer = running.result()
            assert answer.status_code == 503 and "stopped before this request finished" in answer.text
        assert busy.proc.wait(timeout=15) == 0
    finally:
        busy.stop()

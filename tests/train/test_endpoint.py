"""Regeneration through an OpenAI-compatible server: a real `specheads serve` on loopback writes what the in-process
path writes (greedy), a killed run resumes asking only for what was not answered, and a server answering errors is
retried, ends a conversation, or stops the run with its message, as the error says."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.train.data import load_conversations
from specheads.train.endpoint import Endpoint, EndpointAnswerer, EndpointError
from specheads.train.regenerate import TargetAnswerer, main, regenerate
from tests.conftest import tiny_model, tiny_tokenizer
from tests.train.test_regenerate import write_conversations

pytest.importorskip("uvicorn")
from tests.inference.serve.live_server import LiveServer, Slow  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def conversations(tmp_path, n: int) -> list[list[dict]]:
    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=n)
    return load_conversations(str(data))[0]["messages"]


def test_a_served_target_writes_what_the_in_process_path_writes(target, tmp_path):
    convs = conversations(tmp_path, 5)
    here = regenerate(convs, tmp_path / "here", TargetAnswerer(target, tiny_tokenizer(), batch_size=1,
                                                                max_new_tokens=6, stop_ids=[2]), shard_size=2)
    live = LiveServer(Engine(target, AutoregressiveProposer(), max_rows=4), tiny_tokenizer(), max_tokens=64)
    try:
        answerer = EndpointAnswerer(Endpoint(live.url, concurrency=3), max_new_tokens=6)
        served = regenerate(convs, tmp_path / "served", answerer, shard_size=2)
        answerer.close()
    finally:
        live.close()
    assert answerer.model == "tiny" and answerer.requests == 1 + 2 * 5  # the model list, then two turns each
    assert (here.kept, served.kept) == (5, 5)
    assert served.joined.read_text() == here.joined.read_text()
    assert [p.name for p in sorted((tmp_path / "served").glob("shard_*"))] == [
        "shard_00000.jsonl", "shard_00001.jsonl", "shard_00002.jsonl"]


def answered_so_far(out) -> int:
    done = sum(len(p.read_text().splitlines()) for p in out.glob("shard_?????.jsonl"))
    return done + sum(p.read_text().count("\n") for p in out.glob("*.partial.jsonl"))


def test_a_killed_run_resumes_asking_only_for_what_was_not_answered(target, tmp_path):
    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=8)
    live = LiveServer(Engine(target, Slow(delay=0.03), max_rows=4), tiny_tokenizer(), max_tokens=64)
    out = tmp_path / "served"
    args = ["--source", str(data), "--output", str(out), "--endpoint", live.url + "/v1", "--max-new-tokens", "8",
            "--concurrency", "2", "--shard-size", "3"]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "specheads.train.regenerate", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while answered_so_far(out) < 2:  # killed once some conversations are answered, with others in flight
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        before = answered_so_far(out)
        assert 2 <= before < 8
        answerer = EndpointAnswerer(Endpoint(live.url), max_new_tokens=8)
        again = regenerate(load_conversations(str(data))[0]["messages"], out, answerer, shard_size=3)
        answerer.close()
        whole = regenerate(load_conversations(str(data))[0]["messages"], tmp_path / "whole",
                           EndpointAnswerer(Endpoint(live.url), max_new_tokens=8), shard_size=3)
    finally:
        live.close()
    assert (again.resumed, again.answered, again.kept) == (before, 8 - before, 8)
    assert answerer.requests == 1 + 2 * (8 - before)  # nothing answered before was asked again
    assert again.joined.read_text() == whole.joined.read_text()  # and nothing answered was lost
    assert not list(out.glob("*.partial.jsonl"))


class ScriptedServer:
    """An OpenAI-compatible server on loopback that checks every request and answers as `reply(body)` says:
    (status, json body). It records the requests and any malformed one."""

    def __init__(self, reply) -> None:
        self.requests: list[dict] = []
        self.malformed: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    outer.malformed.append(f"GET {self.path}")
                self._send(200, {"object": "list", "data": [{"id": "served-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                problems = [] if self.path == "/v1/chat/completions" else [f"POST {self.path}"]
                if body.get("model") != "served-model" or body.get("max_tokens") != 8 or body.get("temperature") != 0:
                    problems.append(f"settings {body}")
                messages = body.get("messages") or []
                if not messages or messages[-1].get("role") != "user" or any(
                        set(m) != {"role", "content"} for m in messages):
                    problems.append(f"messages {messages}")
                outer.malformed += problems
                outer.requests.append(body)
                self._send(*reply(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def echo(body: dict) -> tuple[int, dict]:
    last = body["messages"][-1]["content"]
    return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f" echo {last} "},
                              "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}


def test_passing_failures_are_retried_and_a_refused_turn_ends_its_conversation(tmp_path):
    calls = {"n": 0}

    def reply(body):
        calls["n"] += 1
        if calls["n"] <= 2:  # the server is busy at first
            return 503, {"error": {"message": "overloaded"}}
        if body["messages"][0]["content"] == "w7 w8 w7" and len(body["messages"]) > 1:
            return 400, {"object": "error", "message": "this prompt is longer than the context"}
        return echo(body)

    server = ScriptedServer(reply)
    try:
        answerer = EndpointAnswerer(Endpoint(server.url, concurrency=1, backoff_s=0.01), max_new_tokens=8)
        done = regenerate(conversations(tmp_path, 4), tmp_path / "out", answerer, shard_size=2)
    finally:
        server.close()
    assert server.malformed == [] and answerer.retried == 2
    rows = [json.loads(line)["messages"] for line in done.joined.read_text().splitlines()]
    assert [len(r) for r in rows] == [4, 4, 2, 4]  # the third conversation's second turn was refused
    assert rows[2] == [{"role": "user", "content": "w7 w8 w7"}, {"role": "assistant", "content": "echo w7 w8 w7"}]
    assert rows[0][3] == {"role": "assistant", "content": "echo w9 w10"}


def test_a_refusal_a_retry_cannot_mend_stops_the_run_with_the_servers_message(tmp_path, capsys):
    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=2)
    server = ScriptedServer(lambda body: (401, {"error": {"message": "invalid API key"}}))
    try:
        assert main(["--source", str(data), "--output", str(tmp_path / "out"), "--endpoint", server.url,
                     "--max-new-tokens", "8"]) == 2
    finally:
        server.close()
    err = capsys.readouterr().err
    # the message names the fix; the two conversations in flight asked once each, nothing retried
    assert "answered 401 invalid API key (pass --api-key)" in err and len(server.requests) == 2
    down = ScriptedServer(lambda body: (503, {"error": {"message": "overloaded"}}))
    try:
        answerer = EndpointAnswerer(Endpoint(down.url, retries=2, backoff_s=0.0), max_new_tokens=8)
        with pytest.raises(EndpointError, match="failed 3 times, last with 503 overloaded; .* rerun the same command"):
            regenerate(conversations(tmp_path, 1), tmp_path / "down", answerer)
    finally:
        down.close()
    with pytest.raises(EndpointError, match="--endpoint must be an http"):
        Endpoint("localhost:8000")

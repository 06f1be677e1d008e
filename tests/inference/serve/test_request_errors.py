"""Malformed request bodies, table-driven: each gets a 4xx in OpenAI's error shape from the one handler
(`request_errors.py`), whatever layer finds the fault, with a message naming the field and what it takes; the server
answers the next good request as before.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.serve.request_errors import validation_message
from tests.conftest import TINY_VOCAB, tiny_model, tiny_tokenizer
from tests.inference.serve.live_server import LiveServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = {"role": "user", "content": "w3 w4"}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_RANGE = re.escape(f"seed must be in [{INT64_MIN}, {INT64_MAX}] (a signed 64-bit integer), got ")


def chat(**fields) -> dict:
    return {"messages": [USER], "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"prompt": "w3 w4", "max_tokens": 2, **fields}


# (endpoint, body: a dict sent as JSON or raw bytes, status, param, message pattern)
MALFORMED = [
    # encoding and JSON
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, "could not be read.*UTF-8"),
    (COMPLETIONS, b"\x80\x81\x82", 400, None, "could not be read|not valid JSON"),
    (CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    (COMPLETIONS, b"", 400, None, "not valid JSON|could not be read|body is required"),
    (CHAT, b"[1, 2]", 400, None, "request body should be a JSON object, got \\[1, 2\\]"),
    (COMPLETIONS, b'"w3 w4"', 400, None, "request body should be a JSON object"),
    # types
    (CHAT, chat(top_logprobs="x"), 400, "top_logprobs", "top_logprobs should be a valid integer, got \"x\""),
    (CHAT, chat(temperature="0.7"), 400, "temperature", "temperature should be a valid number"),
    (CHAT, chat(max_tokens=2.5), 400, "max_tokens", "max_tokens should be a valid integer, got 2.5"),
    (CHAT, chat(stream="yes"), 400, "stream", "stream should be a valid boolean"),
    (COMPLETIONS, completion(seed=[1]), 400, "seed", "seed should be a valid integer"),
    (COMPLETIONS, completion(stop=5), 400, "stop", "stop should be a valid string or a valid list"),
    (COMPLETIONS, {"prompt": {"text": "w3"}}, 400, "prompt", "prompt should be a valid string or a valid list"),
    (CHAT, {"messages": "w3 w4"}, 400, "messages", "messages should be a valid list"),
    (CHAT, {"messages": [USER, 7]}, 400, "messages[1]", r"messages\[1\] should be a JSON object, got 7"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     r"messages\[0\]\.content should be a valid string or a valid list, got 5"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", r"messages\[0\]\.content\[0\]\.type should be 'text'"),
    (CHAT, {"messages": [{"role": "robot", "content": "w3"}]}, 400, "messages[0].role",
     r"messages\[0\]\.role should be 'system', 'developer', 'user' or 'assistant', got \"robot\""),
    (CHAT, chat(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage",
     "stream_options.include_usage should be a valid boolean"),
    (CHAT, chat(spec_decode_metrics="everything"), 400, "spec_decode_metrics", "spec_decode_metrics should be"),
    # ranges
    (CHAT, chat(max_tokens=0), 400, "max_tokens", r"max_tokens must be in \[1, 64\]"),
    (CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens", r"max_completion_tokens must be in \[1, 64\]"),
    (CHAT, chat(temperature=-0.5), 400, "temperature", "temperature must be >= 0"),
    (COMPLETIONS, completion(top_p=1.5), 400, "top_p", r"top_p must be in \(0, 1\]"),
    (COMPLETIONS, completion(top_k=-2), 400, "top_k",
     rf"top_k must be in \[0, {INT64_MAX}\] \(0 keeps every token\), got -2"),
    (CHAT, chat(top_logprobs=-1), 400, "top_logprobs", r"top_logprobs must be in \[0, 20\], got -1"),
    (CHAT, chat(n=0), 400, "n", "n=0 is not supported"),
    (COMPLETIONS, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", "stop takes up to 4"),
    (COMPLETIONS, completion(stop=[""]), 400, "stop", "non-empty strings"),
    (COMPLETIONS, {"prompt": [3, 999999]}, 400, "prompt[1]",
     rf"prompt\[1\] must be a token id of this model, in \[0, {TINY_VOCAB - 1}\], got 999999"),
    (COMPLETIONS, {"prompt": [3, TINY_VOCAB]}, 400, "prompt[1]", rf"in \[0, {TINY_VOCAB - 1}\], got {TINY_VOCAB}$"),
    (COMPLETIONS, {"prompt": [-1, 3]}, 400, "prompt[0]", r"prompt\[0\] must be a token id .* got -1$"),
    (COMPLETIONS, {"prompt": [3, 4, 2**70]}, 400, "prompt[2]", rf"prompt\[2\] .* got {2**70}$"),
    # integers past what generation takes: refused before it starts, never a 500 from inside it
    (CHAT, chat(seed=2**70), 400, "seed", SEED_RANGE + str(2**70)),
    (CHAT, chat(seed=2**64), 400, "seed", SEED_RANGE + str(2**64)),
    (COMPLETIONS, completion(seed=2**63), 400, "seed", SEED_RANGE + str(2**63)),
    (COMPLETIONS, completion(seed=INT64_MIN - 1), 400, "seed", SEED_RANGE + str(INT64_MIN - 1)),
    (CHAT, chat(max_tokens=2**70), 400, "max_tokens", rf"max_tokens must be in \[1, 64\] .*, got {2**70}"),
    (CHAT, chat(max_completion_tokens=2**70), 400, "max_completion_tokens", rf"must be in \[1, 64\] .*, got {2**70}"),
    (CHAT, chat(max_tokens=2**70, max_completion_tokens=2), 400, "max_tokens", "max_tokens must be in"),
    (COMPLETIONS, completion(top_k=2**63), 400, "top_k", rf"top_k must be in \[0, {INT64_MAX}\] .*, got {2**63}"),
    (CHAT, chat(top_logprobs=2**70), 400, "top_logprobs", rf"top_logprobs must be in \[0, 20\], got {2**70}"),
    (CHAT, chat(n=2**70), 400, "n", f"n={2**70} is not supported"),
    (CHAT, chat(n=-1), 400, "n", "n=-1 is not supported"),
    (COMPLETIONS, completion(best_of=2**70), 400, "best_of", f"best_of={2**70} is not supported"),
    (COMPLETIONS, completion(logprobs=2**70), 400, "logprobs", f"logprobs={2**70} is not supported"),
    (CHAT, chat(logit_bias={str(2**70): 1}), 400, "logit_bias", "logit_bias=.* is not supported"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "the prompt is empty"),
    (CHAT, {"messages": []}, 400, "messages", "at least one message"),
    # nulls where a value is required (a null optional field is its default: see the test below)
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content",
     r"messages\[0\]\.content must not be null"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", r"messages\[0\]\.content is required"),
    (CHAT, {"messages": [{"role": None, "content": "w3"}]}, 400, "messages[0].role", "must not be null"),
    (CHAT, {"messages": None}, 400, "messages", "messages must not be null"),
    (CHAT, {"messages": [None]}, 400, "messages[0]", r"messages\[0\] must not be null"),
    (COMPLETIONS, {"prompt": None}, 400, "prompt", "prompt must not be null"),
    # unknown fields and known ones this server does not implement
    (CHAT, chat(temprature=0), 400, "temprature", "unrecognized request argument 'temprature'.*remove it"),
    (COMPLETIONS, completion(repetition_penalty=1.1), 400, "repetition_penalty",
     "unrecognized request argument 'repetition_penalty'"),
    (CHAT, {"messages": [{"role": "user", "content": "w3", "tool_call_id": "x"}]}, 400, "messages[0].tool_call_id",
     r"unrecognized request argument 'messages\[0\]\.tool_call_id'"),
    (CHAT, chat(stream_options={"include_usage": True, "continuous_usage_stats": True}), 400,
     "stream_options.continuous_usage_stats", "unrecognized request argument 'stream_options.continuous_usage_stats'"),
    (CHAT, chat(logprobs=True), 400, "logprobs", "logprobs=True is not supported: this server returns no log prob"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs", "top_logprobs=3 is not supported"),
    (CHAT, chat(logit_bias={"5": 10}), 400, "logit_bias", "logit_bias=.* is not supported: it would change"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "no tool calling"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice", "no tool calling"),
    (COMPLETIONS, completion(echo=True), 400, "echo", "echo=True is not supported"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of", "best_of=3 is not supported"),
    (COMPLETIONS, completion(suffix="w9"), 400, "suffix", "suffix='w9' is not supported"),
    (COMPLETIONS, completion(presence_penalty=0.2), 400, "presence_penalty", "presence_penalty=0.2 is not supported"),
    # a field of the other endpoint
    (COMPLETIONS, completion(messages=[USER]), 400, "messages", "unrecognized request argument 'messages'"),
    (CHAT, chat(echo=True), 400, "echo", "unrecognized request argument 'echo'"),
    (COMPLETIONS, completion(max_completion_tokens=4), 400, "max_completion_tokens",
     "unrecognized request argument 'max_completion_tokens'"),
]


@pytest.fixture(scope="module")
def server():
    live = LiveServer(Engine(tiny_model("llama", seed=0), AutoregressiveProposer(), max_rows=2), tiny_tokenizer(),
                      max_tokens=64)
    yield live
    live.close()


def send(server: LiveServer, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), MALFORMED,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, *_) in enumerate(MALFORMED)])
def test_a_malformed_body_gets_an_openai_error_naming_the_field(server, path, body, status, param, message):
    r = send(server, path, body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}, r.text  # OpenAI's shape, nothing of the framework's ("detail")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert re.search(message, error["message"]), error["message"]


def test_null_optional_fields_take_their_defaults_as_in_openais_api(server):
    body = chat(temperature=None, top_p=None, n=None, stream=None, stop=None, seed=None, logprobs=None,
                top_logprobs=None, presence_penalty=None, user=None, tools=None, response_format=None)
    r = send(server, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_known_inert_arguments_are_accepted(server):
    """What identifies the caller or changes nothing in the answer passes: OpenAI's clients send these."""
    r = send(server, CHAT, chat(temperature=0, user="u1", metadata={"k": "v"}, store=False, n=1, logprobs=False,
                                top_logprobs=0, tool_choice="none", parallel_tool_calls=True, presence_penalty=0,
                                stream_options=None, logit_bias={}, tools=[], prompt_cache_key="c"))
    assert r.status_code == 200, r.text
    plain = send(server, CHAT, chat(temperature=0))
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("seed", [INT64_MIN, -1, 0, INT64_MAX])
def test_every_seed_in_range_generates_and_reproduces(server, seed):
    body = chat(temperature=1.0, seed=seed, max_tokens=4)
    answers = [send(server, CHAT, body) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200], answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] >= 1
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]


def test_the_largest_integers_accepted_generate(server):
    """The top of each range is served: the largest top_k keeps every token (as 0 does), max_tokens reaches the
    server's limit, and a prompt may hold the first and the last token id of the vocabulary."""
    sampled = completion(temperature=1.0, seed=INT64_MAX, max_tokens=64)
    widest = send(server, COMPLETIONS, {**sampled, "top_k": INT64_MAX})
    assert widest.status_code == 200, widest.text
    assert widest.json()["choices"][0]["text"] == send(server, COMPLETIONS, sampled).json()["choices"][0]["text"]
    r = send(server, CHAT, chat(max_completion_tokens=64, temperature=0))
    assert r.status_code == 200, r.text
    r = send(server, COMPLETIONS, {"prompt": [0, TINY_VOCAB - 1], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize(("method", "path", "status"), [("POST", "/v1/embeddings", 404), ("GET", CHAT, 405),
                                                         ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_get_openais_error_shape(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status and path in r.json()["error"]["message"]


def test_the_messages_name_the_deepest_field_a_union_member_reached():
    """A value that fits no member of a union: the member it came closest to names the field."""
    errors = [{"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "Input should be a valid string",
               "input": [3, "x"]},
              {"type": "string_type", "loc": ("body", "prompt", "list[str]", 0), "msg": "Input should be a valid "
               "string", "input": 3},
              {"type": "int_type", "loc": ("body", "prompt", "list[int]", 1), "msg": "Input should be a valid integer",
               "input": "x"}]
    assert validation_message(errors, {"prompt"}) == ("prompt[0] should be a valid string, got 3", "prompt[0]")
    assert validation_message([], {"prompt"}) == ("the request body is invalid", None)

"""Structured outputs through a real server with speculation on: the official `openai` client's
`response_format={"type": "json_schema", ...}` returns valid JSON equal to plain constrained greedy decoding, streamed
and not; vLLM's `structured_outputs` and `guided_*` fields work on /v1/completions; bad constraints are a 400."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("llguidance")

from specheads.inference.engine.engine import Engine  # noqa: E402
from specheads.inference.engine.grammar import json_schema_grammar, regex_grammar  # noqa: E402
from specheads.inference.methods import METHODS, make_proposer  # noqa: E402
from specheads.target import render_messages  # noqa: E402
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model  # noqa: E402
from tests.inference.engine.test_constraint import reference_constrained_greedy  # noqa: E402
from tests.inference.serve.live_server import MODEL, LiveServer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "size", "ok"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": 'Describe the item as JSON, e.g. {"colour": "red", "size": "M", "ok": true}'}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>{% endif %}")
    return tok


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", vocab=BYTE_VOCAB)


@pytest.fixture(scope="module")
def server(target, tokenizer):
    proposer = make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None)
    live = LiveServer(Engine(target, proposer, max_rows=2), tokenizer, max_tokens=96)
    yield live
    live.close()


def reference_text(target, tokenizer, prompt_ids: list[int], grammar, max_new_tokens: int) -> str:
    out = reference_constrained_greedy(target, prompt_ids, grammar, max_new_tokens)
    return tokenizer.decode([t for t in out if t != tokenizer.eos_token_id])


def test_json_schema_through_the_openai_client_equals_constrained_greedy(server, target, tokenizer):
    want = reference_text(target, tokenizer, render_messages(tokenizer, MESSAGES), json_schema_grammar(SCHEMA), 96)
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=96,
                                           response_format=RESPONSE_FORMAT)
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == "stop"
    document = json.loads(want)
    assert set(document) == {"colour", "size", "ok"} and document["size"] in ("S", "M", "L")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=96,
                                            response_format=RESPONSE_FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_vllm_fields_on_completions(server, target, tokenizer):
    prompt = "Three letters then digits: "
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for body in ({"structured_outputs": {"regex": "[a-c]{3}[0-9]{2,4}"}}, {"guided_regex": "[a-c]{3}[0-9]{2,4}"}):
        want = reference_text(target, tokenizer, ids, regex_grammar("[a-c]{3}[0-9]{2,4}"), 16)
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "temperature": 0,
                                                                 "max_tokens": 16, **body}, timeout=60).json()
        assert reply["choices"][0]["text"] == want, body
        assert len(want) in (5, 6, 7) and want[:3].strip("abc") == ""
    choice = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 16,
                                                              "guided_choice": ["yes", "no"]}, timeout=60).json()
    assert choice["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
])
def test_bad_constraints_are_a_400_naming_them(server, body, param):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]

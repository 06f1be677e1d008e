"""`specheads loadtest` against two real servers on loopback ports: speculation on (a draft model) and plain (`ar`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specheads.inference.cli import main
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from specheads.inference.serve.loadtest import loadtest, mismatches, percentile
from specheads.target import render_messages
from tests.conftest import perturbed_copy, repetitive_prompt, tiny_model, tiny_tokenizer
from tests.inference.serve.live_server import STOPS, LiveServer

PROMPTS = [" ".join(f"w{t}" for t in repetitive_prompt(12, seed)) for seed in range(1, 6)]


@pytest.fixture(scope="module")
def servers():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    on = LiveServer(Engine(target, DraftModelProposer(perturbed_copy(target, 0.02)), max_rows=4), tokenizer,
                    max_tokens=64)
    off = LiveServer(Engine(target, AutoregressiveProposer(), max_rows=4), tokenizer, max_tokens=64)
    yield target, tokenizer, on, off
    on.close()
    off.close()


def test_percentiles_interpolate_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_levels_run_every_server_in_turn_and_every_answer_is_the_greedy_one(servers):
    target, tokenizer, on, off = servers
    seen = []
    results = loadtest([("on", on.url), ("off", off.url)], PROMPTS, concurrency=[1, 3], requests=lambda c: 2 * c,
                       max_tokens=12, progress=seen.append)
    assert [(r.label, r.concurrency, r.requests) for r in results] == [("on", 1, 2), ("off", 1, 2), ("on", 3, 6),
                                                                        ("off", 3, 6)]
    assert len(seen) == 4
    for r in results:
        assert r.failed == 0 and len(r.answers) == r.requests
        assert r.requests_per_s > 0 and r.output_tokens_per_s > 0
        assert r.latency_p99_s >= r.latency_p50_s >= r.ttft_p50_s > 0
        assert all(0 < a.tokens <= 12 for a in r.answers)
    assert mismatches(results) == []
    ids = render_messages(tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    want = Engine(target, AutoregressiveProposer()).generate(ids, max_new_tokens=12, stop_token_ids=STOPS).output_ids
    answer = next(a for a in results[2].answers if a.prompt == 0)  # speculation on, three clients at once
    assert answer.text == tokenizer.decode(want, skip_special_tokens=True)
    # a server answering differently, or failing, is reported
    first = results[0].answers[0]
    changed = replace(results[0], answers=(replace(first, text=first.text + "!"), *results[0].answers[1:]))
    assert any("answered differently" in m for m in mismatches([results[1], changed]))
    failed = replace(results[0], answers=(replace(first, error="HTTP 500: boom"),))
    assert mismatches([failed]) == [f"prompt {first.prompt}: on at concurrency 1 failed: HTTP 500: boom"]


def test_the_loadtest_command_prints_and_writes_each_level(servers, tmp_path, capsys):
    _, _, on, off = servers
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [p]})
                                   for i, p in enumerate(PROMPTS)))
    out = tmp_path / "load.json"
    assert main(["loadtest", "--server", f"on={on.url}", "--server", f"off={off.url}/", "--questions", str(questions),
                 "--concurrency", "2", "--requests", "1", "--max-tokens", "6", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "every answer agreed" in printed and "req/s" in printed
    data = json.loads(out.read_text())
    # 2 prompts (--per-category 2), one request each
    assert [(level["label"], level["requests"]) for level in data["levels"]] == [("on", 2), ("off", 2)]
    assert main(["loadtest", "--server", "on=http://127.0.0.1:9", "--questions", str(questions)]) == 2
    assert "does not answer GET /v1/models" in capsys.readouterr().err
    assert main(["loadtest", "--server", "nourl", "--questions", str(questions)]) == 2
    assert "write LABEL=URL" in capsys.readouterr().err

"""Structured outputs from the command line: `generate --regex / --json-schema / --structured` and `bench`'s
`+structured=1` methods, on a tiny saved target with a byte-level tokenizer."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")

from specheads.inference.cli import main  # noqa: E402
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}
QUESTIONS = [
    {"question_id": "j1", "category": "json", "turns": ['Give {"colour": "red", "ok": true} again'],
     "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}},
    {"question_id": "t1", "category": "text", "turns": ["abc abc abc"]},
]


@pytest.fixture(scope="module")
def byte_target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte-target")
    tiny_model("llama", vocab=BYTE_VOCAB).save_pretrained(path)
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>{% endif %}")
    tok.save_pretrained(path)
    return path


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_generate_with_a_regex_or_a_schema(byte_target_dir, tmp_path, capsys):
    code = main(["generate", "--target", str(byte_target_dir), "--method", "ngram", "--prompt", "abc123 abc",
                 "--max-new-tokens", "12", "--regex", "[a-c]{3}[0-9]{2,3}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.fullmatch(r"[a-c]{3}[0-9]{2,3}", out.strip()), out
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code = main(["generate", "--target", str(byte_target_dir), "--prompt", "x", "--max-new-tokens", "40",
                 "--json-schema", str(schema)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert set(json.loads(out.strip())) == {"colour", "ok"}


def test_generate_structured_applies_each_questions_own_format(byte_target_dir, questions_file, tmp_path, capsys):
    out_path = tmp_path / "out.jsonl"
    code = main(["generate", "--target", str(byte_target_dir), "--method", "ngram", "--questions", str(questions_file),
                 "--structured", "--max-new-tokens", "40", "--output", str(out_path)])
    assert code == 0, capsys.readouterr().err
    rows = {r["question_id"]: r for r in map(json.loads, out_path.read_text().splitlines())}
    assert set(json.loads(rows["j1"]["text"])) == {"colour", "ok"}
    with pytest.raises(json.JSONDecodeError):  # the unconstrained question's answer is this tiny model's noise
        json.loads(rows["t1"]["text"])


def test_bench_structured_methods_compare_with_structured_ar(byte_target_dir, questions_file, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    code = main(["bench", "--target", str(byte_target_dir), "--methods", "ar,ar+structured=1,ngram+structured=1",
                 "--questions", str(questions_file), "--max-new-tokens", "24", "--warmup", "0", "--no-plots",
                 "--output", str(out_dir)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    by = {(r["method"], r["question_id"]): r for r in rows}
    assert by[("ngram+structured=1", "j1")]["output_ids"] == by[("ar+structured=1", "j1")]["output_ids"]
    assert by[("ar+structured=1", "j1")]["output_ids"] != by[("ar", "j1")]["output_ids"]
    assert by[("ar+structured=1", "t1")]["output_ids"] == by[("ar", "t1")]["output_ids"]  # no format: unconstrained
    assert all(r["matches_ar"] for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--regex", "[a-"], "regex constraint does not compile"),
    (["--json-schema", "missing.json"], "--json-schema missing.json does not exist"),
    (["--structured"], "--structured reads each question's response_format"),
])
def test_bad_constraints_give_one_clear_line(byte_target_dir, capsys, args, message):
    code = main(["generate", "--target", str(byte_target_dir), "--prompt", "x", "--max-new-tokens", "4", *args])
    assert code == 2 and message in capsys.readouterr().err

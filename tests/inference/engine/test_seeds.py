"""`--seed` gives every question, turn and sample its own reproducible random stream: runs repeat, questions and
samples draw independently (the chi-square law holds over seeded draws of one prompt), and a question's output
does not depend on which other questions are asked."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from specheads.inference.cli import main
from specheads.inference.engine.sampling import SamplingParams
from specheads.target import load_target, render_chat
from tests.drafters import chi_square_p, exact_two_token_law

PROMPT = "w10 w11 w12 w13 w10 w11"


def test_each_draw_gets_its_own_seed():
    params = SamplingParams(temperature=1.0, seed=7)
    seeds = {params.for_draw(qid, turn, sample).seed for qid in (1, "1", 2) for turn in (1, 2) for sample in (0, 1)}
    assert len(seeds) == 12  # question ids 1 and "1" are different questions
    assert params.for_draw(1, 2, 1) == params.for_draw(1, 2, 1)  # the same draw, the same stream
    assert params.for_draw(1).temperature == 1.0 and params.for_draw(1).seed != 7
    unseeded = SamplingParams(temperature=1.0)
    assert unseeded.for_draw(1, 1, 3) is unseeded  # the global RNG already draws independently


def generate(tiny_model_dir, tmp_path, name: str, *args: str) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    assert main(["generate", "--target", str(tiny_model_dir), "--temperature", "1.0", "--top-k", "3",
                 "--output", str(out), *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def write_questions(path, ids) -> str:
    path.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [PROMPT]}) + "\n" for i in ids))
    return str(path)


@pytest.mark.usefixtures("one_thread")
def test_seeded_runs_repeat_and_each_question_keeps_its_own_stream(tiny_model_dir, tmp_path):
    every = write_questions(tmp_path / "all.jsonl", range(40))
    some = write_questions(tmp_path / "some.jsonl", range(20, 40))
    common = ("--method", "ngram", "--max-new-tokens", "4", "--seed", "7")
    first = generate(tiny_model_dir, tmp_path, "first", "--questions", every, *common)
    again = generate(tiny_model_dir, tmp_path, "again", "--questions", every, *common)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    fewer = generate(tiny_model_dir, tmp_path, "fewer", "--questions", some, *common)
    assert [r["output_ids"] for r in fewer] == [r["output_ids"] for r in first[20:]]
    assert len({tuple(r["output_ids"]) for r in first}) > 5  # one prompt, 40 questions: not one sample repeated


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", [["--method", "ar"], ["--method", "ngram"],
                                    ["--method", "draft", "--draft", "early-exit:1"]])
def test_seeded_samples_of_one_prompt_follow_the_targets_law(tiny_model_dir, tmp_path, method):
    """The first two tokens of 400 seeded samples of one prompt against the target's exact law (top-3, 9 cells)."""
    rows = generate(tiny_model_dir, tmp_path, "samples", "--prompt", PROMPT, "--num-samples", "400", "--seed", "7",
                    "--max-new-tokens", "3", *method)
    assert [r["sample"] for r in rows] == list(range(400)) and {r["question_id"] for r in rows} == {None}
    target, tokenizer = load_target(str(tiny_model_dir))
    law = exact_two_token_law(target, render_chat(tokenizer, [PROMPT]), SamplingParams(temperature=1.0, top_k=3))
    counts = Counter(tuple(r["output_ids"][:2]) for r in rows)
    assert chi_square_p(counts, law) > 1e-3, counts


def test_repeated_question_ids_under_a_seed_are_refused(tiny_model_dir, tmp_path, capsys):
    questions = write_questions(tmp_path / "copies.jsonl", [5, 5, 5])
    code = main(["generate", "--target", str(tiny_model_dir), "--questions", questions, "--max-new-tokens", "2",
                 "--temperature", "1.0", "--seed", "7"])
    assert code == 2
    assert "question_id 5 appears 3 times" in capsys.readouterr().err
    code = main(["bench", "--target", str(tiny_model_dir), "--questions", questions, "--max-new-tokens", "2",
                 "--methods", "ar"])
    assert code == 2 and "question ids must be distinct" in capsys.readouterr().err

"""scripts/lab/per_question.py: τ summed and per question against a reference, from a bench's results.jsonl."""

from __future__ import annotations

import json

import pytest

from tests.scripts.lab import load_script


def _write(folder, answers):
    folder.mkdir()
    with (folder / "results.jsonl").open("w") as f:
        for method, question, new_tokens, steps, at_least in answers:
            f.write(json.dumps({"question_id": question, "turn": 1, "method": method, "matches_ar": True,
                                "stats": {"new_tokens": new_tokens, "steps": steps,
                                          "accept_per_position": at_least}}) + "\n")


def test_tau_is_summed_and_set_against_the_mean_of_the_references_per_question(tmp_path):
    script = load_script("per_question")
    _write(tmp_path / "bench", [
        ("eagle3:runs/a/final+lookup=0", 1, 100, 50, [0.6, 0.4, 0.0]),   # τ 2.0
        ("eagle3:runs/a/final+lookup=0", 2, 30, 20, [0.5, 0.0, 0.0]),    # τ 1.5
        ("eagle3:runs/a/final+lookup=0", 3, 40, 40, [0.0, 0.0, 0.0]),    # τ 1.0
        ("eagle3:runs/p1/2+lookup=0", 1, 100, 40, [0.8, 0.5, 0.2]),      # τ 2.5
        ("eagle3:runs/p1/2+lookup=0", 2, 30, 20, [0.5, 0.0, 0.0]),       # τ 1.5
        ("eagle3:runs/p1/2+lookup=0", 3, 40, 50, [0.0, 0.0, 0.0]),       # τ 0.8
        ("eagle3:runs/p2/2+lookup=0", 1, 100, 100, [0.0, 0.0, 0.0]),     # τ 1.0
        ("eagle3:runs/p2/2+lookup=0", 2, 30, 20, [0.5, 0.0, 0.0]),       # τ 1.5
        ("eagle3:runs/p2/2+lookup=0", 3, 40, 50, [0.0, 0.0, 0.0]),       # τ 0.8
    ])
    lines = script.table(script.read_answers(tmp_path / "bench"), ["p1/", "p2/"]).splitlines()
    row = lines[2].split(" | ")
    assert row[0] == "| runs/a/final"
    assert row[1] == f"{170 / 110:.3f}"
    # depth 1: (0.6 * 50 + 0.5 * 20) / 110 steps; depth 2: 0.4 * 50 / 110
    assert row[2] == f"{40 / 110:.2f} / {20 / 110:.2f} / 0.00"
    # against the references' mean per question: 2.0 / 1.75, 1.5 / 1.5 (a tie), 1.0 / 0.8
    assert row[3] == f"{2.0 / 1.75:.3f}" and row[4] == "2, 1"
    assert lines[2].endswith("| 3/3 |")


def test_a_reference_that_names_no_single_method_is_refused_with_the_names(tmp_path):
    script = load_script("per_question")
    _write(tmp_path / "bench", [("eagle3:runs/a/final", 1, 10, 5, []), ("eagle3:runs/b/final", 1, 10, 5, [])])
    answers = script.read_answers(tmp_path / "bench")
    with pytest.raises(SystemExit, match="matches 2 methods"):
        script.table(answers, ["final"])
    with pytest.raises(SystemExit, match="runs/a/final"):
        script.table(answers, ["nowhere"])
    with pytest.raises(SystemExit, match="does not exist"):
        script.read_answers(tmp_path / "missing")


def test_benches_join_and_a_method_counts_from_the_first_folder_that_has_it(tmp_path):
    script = load_script("per_question")
    _write(tmp_path / "one", [("ar", 1, 10, 10, []), ("eagle3:runs/a/final", 1, 10, 5, [1.0])])
    _write(tmp_path / "two", [("ar", 1, 10, 10, []), ("eagle3:runs/b/final", 1, 10, 4, [1.0, 0.5]),
                              ("eagle3:runs/a/final", 1, 10, 2, [1.0])])
    answers = script.read_answers(tmp_path / "one", tmp_path / "two")
    assert list(answers) == ["ar", "eagle3:runs/a/final", "eagle3:runs/b/final"]
    assert answers["eagle3:runs/a/final"][0].steps == 5 and len(answers["ar"]) == 1

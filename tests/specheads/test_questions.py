import json

import pytest

from specheads.questions import load_questions


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

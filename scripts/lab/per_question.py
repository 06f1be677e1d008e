"""τ of every method of a bench run, summed over its answers and set against a reference question by question.

A bench's summary gives each method's mean τ. Drafters whose τ differ by a percent or two need more: which of
them wins on how many questions, and the median of the per-question ratios, which one long answer cannot swing.
This reads the results.jsonl of one or more bench folders (greedy answers are exact counts, so runs of the same
questions join: a method found in several folders counts from the first) and prints, per method:

- τ summed: all new tokens over all target forwards (steps) of its answers;
- accepted at depth >= 1 / 2 / 3: the share of those steps that accepted at least so many drafted tokens;
- against the reference: the median over questions of τ / the reference's τ, and the questions won and tied
  (equal τ, which exact counts often give); the reference is the mean τ of the `--against` methods, so several
  runs of one trainer (seeds) can stand together as one;
- the outputs equal to `ar`'s, as the bench marked them.

    .venv/bin/python scripts/lab/per_question.py runs/trainers-20261204/bench-seeds --against peer/2 --against peer-s1/2
    .venv/bin/python scripts/lab/per_question.py runs/x/bench runs/x/bench-more --against peer   # two runs joined

A method is named by what follows its `kind:` and precedes its `+options`, or by its whole name where that is
ambiguous; `--against` takes any part of a name that picks out one method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

DEPTHS = 3  # accepted-at-depth columns


@dataclass(frozen=True)
class Answer:
    question: tuple  # (question_id, turn)
    new_tokens: int
    steps: int
    accept_per_position: list[float]  # [i]: share of this answer's steps accepting >= i+1 drafted tokens
    matches_ar: bool | None


def read_answers(*benches: Path) -> dict[str, list[Answer]]:
    """Each method's answers in the bench folders' results.jsonl, in file order; a method already read from an
    earlier folder is not read again."""
    answers: dict[str, list[Answer]] = {}
    for bench in benches:
        path = bench / "results.jsonl"
        if not path.is_file():
            raise SystemExit(f"{path} does not exist; pass a folder `specheads bench --output` wrote")
        found: dict[str, list[Answer]] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            stats = row["stats"]
            found.setdefault(row["method"], []).append(Answer(
                question=(row["question_id"], row["turn"]), new_tokens=stats["new_tokens"], steps=stats["steps"],
                accept_per_position=stats.get("accept_per_position") or [], matches_ar=row.get("matches_ar")))
        answers |= {method: rows for method, rows in found.items() if method not in answers}
    return answers


def short_names(methods: list[str]) -> dict[str, str]:
    """`eagle3:runs/x/ours/final+lookup=0` -> `runs/x/ours/final`, keeping whole names where two would collide."""
    short = {m: m.split(":", 1)[-1].split("+", 1)[0] for m in methods}
    taken = list(short.values())
    return {m: s if taken.count(s) == 1 else m for m, s in short.items()}


def pick(methods: list[str], part: str) -> str:
    found = [m for m in methods if part in m]
    if len(found) != 1:
        raise SystemExit(f"--against {part!r} matches {len(found)} methods ({', '.join(found) or 'none'}); "
                         f"pass a part of one name of: {', '.join(methods)}")
    return found[0]


def tau(answer: Answer) -> float:
    return answer.new_tokens / answer.steps


def table(answers: dict[str, list[Answer]], against: list[str]) -> str:
    """The markdown table the module doc describes."""
    methods = list(answers)
    references = [pick(methods, part) for part in against]
    by_question = {m: {a.question: a for a in rows} for m, rows in answers.items()}
    shared = set.intersection(*(set(by_question[r]) for r in references)) if references else set()
    reference = {q: statistics.mean(tau(by_question[r][q]) for r in references) for q in shared}
    names = short_names(methods)
    head = ["method", "τ summed", "accepted ≥" + "/≥".join(str(d) for d in range(1, DEPTHS + 1))]
    if references:
        head += ["τ / reference per question: median", "wins, ties"]
    lines = ["| " + " | ".join(head + ["== ar"]) + " |", "|" + "---|" * (len(head) + 1)]
    for method in methods:
        rows = answers[method]
        steps = sum(a.steps for a in rows)
        accepted = [sum(a.accept_per_position[d] * a.steps for a in rows if d < len(a.accept_per_position)) / steps
                    for d in range(DEPTHS)]
        cells = [names[method], f"{sum(a.new_tokens for a in rows) / steps:.3f}",
                 " / ".join(f"{x:.2f}" for x in accepted)]
        if references:
            ratios = [tau(a) / reference[a.question] for a in rows if a.question in reference]
            cells += [f"{statistics.median(ratios):.3f}" if ratios else "-",
                      f"{sum(r > 1 for r in ratios)}, {sum(r == 1 for r in ratios)}" if ratios else "-"]
        checked = [a.matches_ar for a in rows if a.matches_ar is not None]
        lines.append("| " + " | ".join(cells + [f"{sum(checked)}/{len(checked)}" if checked else "-"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path, nargs="+", help="folders `specheads bench --output` wrote")
    parser.add_argument("--against", action="append", default=[],
                        help="the reference method (a part of its name; repeat it for the mean of several)")
    args = parser.parse_args(argv)
    print(table(read_answers(*args.bench), args.against))


if __name__ == "__main__":
    sys.exit(main())

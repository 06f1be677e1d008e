"""Write a repeated-requests workload: the first N questions of a Spec-Bench JSONL file, then each of them again with
a small edit, as agents and retrying clients send them (a question reworded at its start, a request appended).

    .venv/bin/python scripts/lab/make_repeated_requests.py mt_bench.jsonl --first 6 \
        --output runs/repeated.jsonl
    specheads bench --methods ar,ngram,suffix,lookahead --questions runs/repeated.jsonl --max-new-tokens 96

Bench answers the questions in file order with one engine per method, so a method that keeps earlier answers
(`suffix`) meets each edited question after its original.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# One edit per repeat, in turn: small changes that leave most of the question's text as it was.
EDITS = (
    lambda text: "Please help with this. " + text,
    lambda text: text + " Keep the answer short.",
    lambda text: text.replace(".", "!", 1) if "." in text else text + "!",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", type=Path, help="a Spec-Bench JSONL file (question_id, category, turns)")
    parser.add_argument("--first", type=int, default=6, help="how many questions to ask twice")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    if args.first < 1:
        raise SystemExit(f"--first must be >= 1, got {args.first}")
    rows = [json.loads(line) for line in args.questions.read_text().splitlines() if line.strip()][: args.first]
    if len(rows) < args.first:
        raise SystemExit(f"{args.questions} has {len(rows)} questions, fewer than --first {args.first}")
    out = [{"question_id": f"{r['question_id']}", "category": "first", "turns": r["turns"][:1]} for r in rows]
    out += [{"question_id": f"{r['question_id']}-again", "category": "repeated",
             "turns": [EDITS[i % len(EDITS)](r["turns"][0])]} for i, r in enumerate(rows)]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"wrote {len(out)} questions to {args.output}")


if __name__ == "__main__":
    main()

"""Does a second run of the main job (`scripts/run.sh`) reproduce the first? Compares two run folders.

    .venv/bin/python scripts/lab/compare_runs.py runs/main-A runs/main-B

What must be equal, byte for byte or token for token, on one machine (same CPU flags, threads and versions):
- the trained drafter: every file of each `*/final` folder (weights, config, draft vocabulary);
- the training curve: every logged loss and evaluation figure in `*/metrics.jsonl` (timings left out);
- the benchmark: for every (method, question, turn), the output tokens and the steps, drafted and accepted counts,
  so τ and acceptance too.
Speed is not reproducible to the digit: it is printed, per method, as the ratio of run B's tokens/s to run A's and
of the speedups against `hf`, so one can see how far the machine's noise moved it.

Exit status 0 when everything that must be equal is, 1 otherwise (each difference printed, the first few per kind).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

COUNTS = ("new_tokens", "steps", "drafted", "accepted")
TIMING_SUFFIXES = ("_s", "_seconds", "time", "elapsed")  # metrics that measure time, which no run repeats
SHOWN = 5  # differences printed per kind


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def drafter_files(run: Path) -> dict[str, str]:
    """'<kind>/final/<file>' -> sha256, for every trained drafter of the run."""
    return {str(f.relative_to(run)): digest(f) for final in sorted(run.glob("*/final"))
            for f in sorted(final.rglob("*")) if f.is_file()}


def curve(run: Path) -> dict[str, dict]:
    """'<kind>@<step>' -> that row's figures (timings left out), from every drafter's metrics.jsonl."""
    rows = {}
    for path in sorted(run.glob("*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            figures = {k: v for k, v in row.items() if not k.endswith(TIMING_SUFFIXES)}
            key = f"{path.parent.name}@{row.get('step')}"
            rows[key] = {**rows.get(key, {}), **figures}
    return rows


def answers(run: Path) -> dict[tuple, dict]:
    """(method, question, turn) -> its output tokens and counts, from bench/results.jsonl."""
    path = run / "bench" / "results.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: is {run} a finished main-job run folder?")
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        # the drafter's folder differs between runs: name a method by its kind only
        method = r["method"].split(":")[0]
        out[method, r["question_id"], r["turn"]] = {"output_ids": r["output_ids"],
                                                    **{k: r["stats"].get(k) for k in COUNTS}}
    return out


def summaries(run: Path) -> dict[str, dict]:
    rows = json.loads((run / "bench" / "summary.json").read_text())
    return {r["method"].split(":")[0]: r for r in rows if r.get("category", "all") == "all"}


def differences(a: dict, b: dict, what: str) -> list[str]:
    found = [f"{what} {k}: only in run A" for k in a.keys() - b.keys()]
    found += [f"{what} {k}: only in run B" for k in b.keys() - a.keys()]
    found += [f"{what} {k}: {a[k]!r:.120} != {b[k]!r:.120}" for k in sorted(a.keys() & b.keys(), key=str)
              if a[k] != b[k]]
    return found


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    args = p.parse_args()
    a, b = args.run_a, args.run_b
    checks = {"drafter file": (drafter_files(a), drafter_files(b)), "training row": (curve(a), curve(b)),
              "answer": (answers(a), answers(b))}
    failed = False
    for what, (x, y) in checks.items():
        found = differences(x, y, what)
        print(f"{what}s: {len(x)} in run A, {len(y)} in run B, {len(found)} differ")
        for line in found[:SHOWN]:
            print(f"    {line}")
        failed |= bool(found) or not x
    sa, sb = summaries(a), summaries(b)
    print("\n| method | τ A | τ B | tok/s B / A | vs hf A | vs hf B |")
    print("|---|---|---|---|---|---|")
    for method in [m for m in sa if m in sb]:
        ra, rb = sa[method], sb[method]
        cells = [_fmt(ra.get("tau")), _fmt(rb.get("tau")), _fmt(rb["tokens_per_s"] / ra["tokens_per_s"]),
                 _fmt(ra.get("speedup_vs_hf")), _fmt(rb.get("speedup_vs_hf"))]
        print(f"| {method} | {' | '.join(cells)} |")
    print("\nreproduced" if not failed else "\nNOT reproduced")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

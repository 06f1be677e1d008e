#!/usr/bin/env bash
# The main job on the default target: set up, then compare methods on MT-bench first turns in one run.
#
#   scripts/run.sh [QUESTIONS.jsonl] [extra `specheads bench` flags]
#
# Writes results.jsonl, summary.json and summary.md under runs/bench-<date>/ and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
questions="${1:-../shared/data/mt_bench.jsonl}"
shift || true
if [[ ! -f "$questions" ]]; then
    echo "questions file $questions not found; pass a Spec-Bench JSONL file as the first argument" >&2
    exit 2
fi
out="runs/bench-$(date +%Y%m%d-%H%M%S)"
exec .venv/bin/specheads bench --target default --methods hf,ar,ngram,draft:early-exit:8 \
    --questions "$questions" --limit 20 --max-new-tokens 128 --output "$out" "$@"

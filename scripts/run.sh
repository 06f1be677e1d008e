#!/usr/bin/env bash
# The main job on the default target (SmolLM2-135M-Instruct), on CPU or GPU:
#   1. set up (.venv, project, default target, ShareGPT data);
#   2. train EAGLE heads with the CPU recipe (~15 min on 2 cores; MEDUSA=1 also trains Medusa heads);
#   3. measure τ and speed on MT-bench first turns (3 questions of each category) against `ar`, HF `generate`
#      and `ngram`, in one run; the EAGLE heads run with the CPU default tree (alone, and with the default
#      prompt-lookup branch grafted on) and with EAGLE-2's 60-node tree.
# The table is printed and written to runs/main-<date>/bench/summary.md.
#
#   scripts/run.sh                       # defaults
#   QUESTIONS=path.jsonl PER_CATEGORY=3 MAX_NEW=128 MEDUSA=1 scripts/run.sh
#   LIMIT=20 scripts/run.sh              # the first 20 questions instead of a balanced subset
#   EXTRA_METHODS=hf-pld,eagle:runs/other/final scripts/run.sh   # more methods in the same interleaved run
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
questions="${QUESTIONS:-../shared/data/mt_bench.jsonl}"
if [[ ! -f "$questions" ]]; then
    echo "questions file $questions not found; set QUESTIONS to a Spec-Bench JSONL file" >&2
    exit 2
fi
run="runs/main-$(date +%Y%m%d-%H%M%S)"
methods="hf,ar,ngram"
echo "==> training EAGLE heads into $run/eagle"
.venv/bin/python -m specheads.train configs/eagle-smollm2-cpu.yaml "output_dir=$run/eagle"
# The heads alone on the CPU default tree, with prompt lookup grafted on (the default), and on EAGLE-2's 60 nodes.
methods="$methods,eagle:$run/eagle/final+lookup=0,eagle:$run/eagle/final,eagle:$run/eagle/final@eagle2"
if [[ "${MEDUSA:-0}" == 1 ]]; then
    echo "==> training Medusa heads into $run/medusa"
    .venv/bin/python -m specheads.train configs/medusa-smollm2-cpu.yaml "output_dir=$run/medusa" \
        "feature_cache_dir=$run/eagle/features"  # same data as the EAGLE recipe: its cached features serve
    methods="$methods,medusa:$run/medusa/final"
fi
if [[ -n "${EXTRA_METHODS:-}" ]]; then
    methods="$methods,$EXTRA_METHODS"
fi
echo "==> benchmarking $methods"
if [[ -n "${LIMIT:-}" ]]; then
    subset=(--limit "$LIMIT")
else
    subset=(--per-category "${PER_CATEGORY:-3}")  # MT-bench: 3 of each of its 8 categories
fi
.venv/bin/specheads bench --target default --methods "$methods" --questions "$questions" \
    "${subset[@]}" --max-new-tokens "${MAX_NEW:-128}" --output "$run/bench"
echo "==> results in $run/bench (summary.md, summary.json, results.jsonl)"

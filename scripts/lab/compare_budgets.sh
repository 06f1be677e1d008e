#!/usr/bin/env bash
# P-EAGLE heads trained for the same minutes under several settings, then benched together: which settings make the
# most of a short time budget (the main job's on a CPU without native bf16).
#
#   MINUTES=10 QUESTIONS=mt_bench.jsonl scripts/lab/compare_budgets.sh runs/budgets \
#       "defaults:" "warmup10:optim.warmup_steps=10" "batch2:optim.batch_size=2 optim.warmup_steps=10"
#
# Each NAME:OVERRIDES trains configs/peagle-smollm2-cpu.yaml with online features, max_minutes=MINUTES and the
# main job's data (600 conversations, so every variant holds out the same ones), one after another on an otherwise
# idle machine; then one interleaved bench (greedy, exact) of ar and every variant's heads, plus EXTRA_METHODS, on
# QUESTIONS (PER_CATEGORY of each category, default 1; MAX_NEW tokens, default 128). τ there comes from exact counts;
# each variant's steps and evaluation are in OUT/NAME/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1
shift
methods=ar
for variant in "$@"; do
    name=${variant%%:*}
    read -r -a overrides <<<"${variant#*:}"
    echo "==> $name: ${overrides[*]:-(recipe defaults)} for ${MINUTES:-10} minutes"
    .venv/bin/python -m specheads.train configs/peagle-smollm2-cpu.yaml "output_dir=$out/$name" features=online \
        max_steps=100000 "max_minutes=${MINUTES:-10}" eval_every=100000 save_every=100000 data.max_conversations=600 \
        "${overrides[@]}"
    methods="$methods,peagle:$out/$name/final"
done
[[ -n "${EXTRA_METHODS:-}" ]] && methods="$methods,$EXTRA_METHODS"
.venv/bin/specheads bench --target default --dtype float32 --methods "$methods" --questions "${QUESTIONS:-humaneval}" \
    --per-category "${PER_CATEGORY:-1}" --max-new-tokens "${MAX_NEW:-128}" --output "$out/bench" --no-plots

#!/usr/bin/env bash
# The heads losses at one budget: P-EAGLE heads for the default target trained with each loss on the same
# conversations, cached features, steps and schedule, then measured in one interleaved `specheads bench` run
# (τ, per-position acceptance, tok/s).
#
#   scripts/lab/compare_losses.sh                       # cross_entropy, nla, lk; 300 steps on 600 conversations
#   LOSSES="cross_entropy tv" STEPS=500 CONVERSATIONS=800 PER_CATEGORY=3 scripts/lab/compare_losses.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
run="runs/losses-$(date +%Y%m%d-%H%M%S)"
steps="${STEPS:-300}"
losses="${LOSSES:-cross_entropy nla lk}"
methods="ar"
for loss in $losses; do
    echo "==> P-EAGLE heads, heads.loss=$loss, $steps steps"
    .venv/bin/python -m specheads.train configs/peagle-smollm2-cpu.yaml "output_dir=$run/$loss" "max_steps=$steps" \
        "eval_every=$steps" "save_every=$steps" "data.max_conversations=${CONVERSATIONS:-600}" "heads.loss=$loss" \
        "feature_cache_dir=$run/features" measure_prompts=0  # every run reads the features the first cached
    methods="$methods,peagle:$run/$loss/final"
done
dtype=$(.venv/bin/python -c "from specheads.gemm_layout import cpu_has_native_bf16
print('bfloat16' if cpu_has_native_bf16() else 'auto')")
.venv/bin/specheads bench --target default --dtype "$dtype" --methods "$methods" \
    --questions "${QUESTIONS:-humaneval}" --per-category "${PER_CATEGORY:-2}" --max-new-tokens 128 \
    --output "$run/bench"
echo "==> results in $run/bench (summary.md)"

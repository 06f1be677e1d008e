#!/usr/bin/env bash
# P-EAGLE heads (or KIND's drafter) trained at one budget under several settings, then benched together: which
# settings make the most of the main job's budget (its minutes on a CPU without native bf16, its steps elsewhere).
#
#   MINUTES=10 QUESTIONS=mt_bench.jsonl scripts/lab/compare_budgets.sh runs/budgets \
#       "defaults:" "warmup10:optim.warmup_steps=10" "batch2:optim.batch_size=2 optim.warmup_steps=10"
#   STEPS=300 DTYPE=bfloat16 QUESTIONS=mt_bench.jsonl PER_CATEGORY=2 scripts/lab/compare_budgets.sh runs/auf \
#       "base:" "auf:heads.accept_until_fail=true" "base-s1:seed=1 data.split_seed=0" \
#       "auf-s1:seed=1 data.split_seed=0 heads.accept_until_fail=true"
#   STEPS=300 ... scripts/lab/compare_budgets.sh runs/op "op:onpolicy.every=50"   # training on its own mistakes
#   KIND=domino MINUTES=9 EXTRA_METHODS=peagle:runs/levers/base-s0/final ... scripts/lab/compare_budgets.sh \
#       runs/domino "domino-s0:optim.batch_size=2 optim.warmup_steps=10"   # another kind in the same minutes
#   MINUTES=9 QUESTIONS=none HELD_OUT=16 MAX_NEW=96 VIEWS="+lookup=0+node_budget=fixed+backend=llamacpp \
#       @chain3+lookup=0+node_budget=fixed+backend=llamacpp" scripts/lab/compare_budgets.sh runs/regen \
#       "none-s0:optim.batch_size=2 optim.warmup_steps=10 data.split_seed=0 measure_prompts=0" \
#       "alone-s0:optim.batch_size=2 optim.warmup_steps=10 data.split_seed=0 measure_prompts=0 regenerate.mode=alone"
#       # the target's own answers (regenerate:, cached before): the heads alone as trees and as chains of 3
#
# (`data.split_seed=0` keeps a seed variant on the same rows, so it reads the features the first variant cached.)
#
# Each NAME:OVERRIDES trains configs/KIND-smollm2-cpu.yaml (KIND default peagle) on the main job's data (600
# conversations, so every variant holds out the same ones), one after another on an otherwise idle machine: with
# MINUTES (default 10), features computed online and max_minutes=MINUTES; with STEPS, max_steps=STEPS on features
# cached once for every variant (OUT/features). Then one interleaved bench of ar and every variant's heads, plus
# EXTRA_METHODS, on QUESTIONS (PER_CATEGORY of each category, default 1; MAX_NEW tokens, default 128) in DTYPE
# (default float32: greedy, exact). τ there comes from exact counts; each variant's steps and evaluation are in
# OUT/NAME/metrics.jsonl, its training wall time in OUT/NAME/train_seconds.txt. With HELD_OUT=N the same methods are
# benched again on N ShareGPT first turns that training never reads (`--questions sharegpt-heldout`) ->
# OUT/bench-heldout (QUESTIONS=none: that bench alone). VIEWS (space-separated) benches each variant's heads once per
# suffix of its method (say "+lookup=0+node_budget=fixed @chain3+lookup=0": the whole tree, then a chain of 3);
# default: the heads as they ship.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1
shift
kind=${KIND:-peagle}
methods=ar
for variant in "$@"; do
    name=${variant%%:*}
    read -r -a overrides <<<"${variant#*:}"
    if [[ -n "${STEPS:-}" ]]; then
        budget=("max_steps=$STEPS" features=offline "feature_cache_dir=$out/features" measure_prompts=0)
    else
        budget=(max_steps=100000 features=online "max_minutes=${MINUTES:-10}")
    fi
    echo "==> $name: ${overrides[*]:-(recipe defaults)} for ${STEPS:-${MINUTES:-10} minutes}${STEPS:+ steps}"
    start=$SECONDS
    .venv/bin/python -m specheads.train "configs/$kind-smollm2-cpu.yaml" "output_dir=$out/$name" "${budget[@]}" \
        eval_every=100000 save_every=100000 data.max_conversations=600 "${overrides[@]}"
    echo "$((SECONDS - start))" > "$out/$name/train_seconds.txt"  # the feature cache included where written
    read -r -a views <<<"${VIEWS:-}"
    [[ ${#views[@]} -eq 0 ]] && views=("")  # the heads as they ship
    for view in "${views[@]}"; do
        methods="$methods,$kind:$out/$name/final$view"
    done
done
[[ -n "${EXTRA_METHODS:-}" ]] && methods="$methods,$EXTRA_METHODS"
bench=(.venv/bin/specheads bench --target default --dtype "${DTYPE:-float32}" --methods "$methods"
       --max-new-tokens "${MAX_NEW:-128}" --no-plots)
if [[ "${QUESTIONS:-humaneval}" != none ]]; then
    "${bench[@]}" --questions "${QUESTIONS:-humaneval}" --per-category "${PER_CATEGORY:-1}" --output "$out/bench"
fi
if [[ -n "${HELD_OUT:-}" ]]; then
    "${bench[@]}" --questions sharegpt-heldout --limit "$HELD_OUT" --output "$out/bench-heldout"
fi

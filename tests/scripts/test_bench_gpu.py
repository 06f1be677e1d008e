"""scripts/bench_gpu.sh packs the default target, wheels, questions and heads into parts small enough to carry one
at a time, and refuses to run on a missing or damaged part. Its full run (install, convert, bench) is what a GPU
machine executes; here it runs once on the CPU with a few tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.heads.checkpoint import TargetInfo, save_drafter
from tests.conftest import random_eagle_head

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_gpu.sh"


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    from specheads.target import load_target

    tmp = tmp_path_factory.mktemp("pack")
    target, _ = load_target("default")
    heads = tmp / "eagle-heads"
    save_drafter(heads, random_eagle_head(target, draft_vocab=tuple(range(3, 2000))),
                 TargetInfo.from_model(target, "default"))
    questions = tmp / "questions.jsonl"
    questions.write_text('{"question_id": 1, "category": "coding", "turns": ["Write a loop in Python."]}\n'
                         '{"question_id": 2, "category": "math", "turns": ["What is 12 * 7?"]}\n')
    out = script("pack", str(tmp / "parts"), f"eagle={heads}", QUESTIONS=str(questions), PART_MIB="40")
    assert out.returncode == 0, out.stderr
    return tmp / "parts"


def test_pack_cuts_parts_under_the_limit_with_checksums(packed):
    parts = sorted(p.name for p in packed.glob("part-*"))
    assert len(parts) >= 3  # the 98 MB GGUF alone needs three 40 MiB parts
    assert all((packed / p).stat().st_size <= 40 * 2**20 for p in parts)
    listed = [line.split()[1] for line in (packed / "SHA256SUMS").read_text().splitlines()]
    assert listed == parts


def test_run_names_a_missing_part_and_a_damaged_one(packed, tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    for f in packed.iterdir():
        if f.name != "part-ab":
            (there / f.name).write_bytes(f.read_bytes())
    out = script("run", str(there), DEVICE="cpu")
    assert out.returncode == 1 and "missing parts: part-ab" in out.stderr, out.stderr
    damaged = bytearray((packed / "part-ab").read_bytes())
    damaged[1000] ^= 1
    (there / "part-ab").write_bytes(bytes(damaged))
    out = script("run", str(there), DEVICE="cpu")
    assert out.returncode == 1 and "a part is damaged" in out.stderr, out.stderr


@pytest.mark.slow
def test_run_installs_converts_and_benches_the_packed_heads(packed):
    # uncompiled: the compiled stack is checked on tiny models (tests/inference/engine/test_lean_forward.py), and
    # compiling the default target for every shape a bench meets takes minutes on a small CPU
    out = script("run", str(packed), "--warmup", "0", DEVICE="cpu", DTYPE="float32", MAX_NEW="6", COMPILE="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device: cpu" in out.stdout
    for method in ("| hf |", "| ar |", "| ngram |", "| eagle:heads/eagle |"):
        assert method in out.stdout, out.stdout
    assert (packed / "home" / "targets").is_dir()  # converted inside DIR, not in the user's cache
    assert "differ from ar" not in out.stderr and (packed / "bench" / "results.jsonl").is_file()  # fp32: exact

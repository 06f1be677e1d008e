"""The configured lint rules hold across the tree (line length included), checked by ruff as part of the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("specheads", "train", "inference", "tests", "scripts")


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True)


def test_the_tree_passes_the_configured_lint_rules():
    done = ruff(*FOLDERS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_line_length_rule_is_on():
    # Guard against a vacuous pass: a line one character past the configured length is reported.
    import tomllib

    limit = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["line-length"]
    line = "x = " + repr("y" * (limit - 6)) + "\n"
    assert len(line.rstrip("\n")) == limit and ruff("--stdin-filename", "ok.py", "-", stdin=line).returncode == 0
    done = ruff("--stdin-filename", "long.py", "-", stdin=line.replace("x =", "xx ="))
    assert done.returncode == 1 and "E501" in done.stdout, done.stdout


def test_no_tracked_file_reads_a_path_outside_the_repository():
    """A user's machine holds the repository alone: no code, script or doc may point beside it."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # the folder beside a checkout, as a path string or joined from parts, spelled so this file does not hold it
    beside = ["/".join(("..", "shared")), " / ".join(('"shared"', '"data"'))]
    outside = [f for f in files if (ROOT / f).is_file()
               and any(spelling in (ROOT / f).read_text(encoding="utf-8", errors="ignore") for spelling in beside)]
    assert outside == []

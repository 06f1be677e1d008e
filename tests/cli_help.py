"""Runs a `specheads` command line in a fresh interpreter and reports what it printed and what it imported."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

NO_TORCH = """
import contextlib, io, json, sys
from specheads.inference.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main({argv!r})
    except SystemExit as stop:
        code = stop.code
print(json.dumps({{"code": code, "help": out.getvalue(), "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}}))
"""


def help_without_torch(python: str, argv: list[str], cwd: Path | None = None) -> dict:
    """What `specheads ARGV` printed and returned, run in a fresh `python`, and whether it imported torch or
    transformers: every command's `--help` must not (it answers at once; see docs/results.md for the times)."""
    proc = subprocess.run([python, "-c", NO_TORCH.format(argv=argv)], capture_output=True, text=True, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])

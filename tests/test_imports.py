"""Dependency direction: specheads imports neither train nor inference; inference never imports train."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add((str(path.relative_to(ROOT)), node.module))
    return found


def test_core_imports_neither_train_nor_inference():
    bad = [(f, m) for f, m in imported_modules(ROOT / "specheads")
           if m.startswith(("specheads.train", "specheads.inference"))]
    assert not bad, bad


def test_inference_never_imports_train():
    bad = [(f, m) for f, m in imported_modules(ROOT / "inference") if m.startswith("specheads.train")]
    assert not bad, bad


def test_the_check_sees_imports():
    # Guard against a vacuous pass: the inference package does import the core.
    assert any(m.startswith("specheads.") for _, m in imported_modules(ROOT / "inference"))

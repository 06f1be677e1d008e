"""Dependency direction: specheads imports neither train nor inference; inference never imports train."""

from __future__ import annotations

import ast
import re
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


def _docstrings(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, owners) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def kind_literals(*, own_files: bool = False) -> list[tuple[str, str, str]]:
    """(file, kind, string) for every string literal (docstrings aside) naming a registered drafter kind, as a
    word, in a library file that is not that kind's own (`<kind>.py` in any package); or only in its own files."""
    from specheads.kinds import KINDS

    found = []
    for folder in ("specheads", "train", "inference"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    for name in KINDS.names():
                        if (path.stem == name) == own_files and re.search(rf"(?<![\w-]){re.escape(name)}(?!\w)", node.value):
                            found.append((str(path.relative_to(ROOT)), name, node.value))
    return found


def test_kind_names_appear_only_in_their_own_files():
    """No shared code branches on (or spells out) a kind's name: lists of names come from the registries."""
    bad = kind_literals()
    assert not bad, bad


def test_the_kind_name_check_sees_literals():
    # Guard against a vacuous pass: each kind's own files do spell its name.
    from specheads.kinds import KINDS

    assert {name for _, name, _ in kind_literals(own_files=True)} == set(KINDS.names())

"""Tests of the experiments in scripts/lab/, which are files rather than modules of the package."""

from __future__ import annotations

from types import ModuleType

from tests.scripts import load_script as load_from


def load_script(name: str) -> ModuleType:
    """scripts/lab/NAME.py as a module (imported fresh, its `main` not run)."""
    return load_from(name, "scripts/lab")

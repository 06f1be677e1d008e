"""Tests of the scripts in scripts/, which are files rather than modules of the package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, folder: str = "scripts") -> ModuleType:
    """FOLDER/NAME.py as a module (imported fresh, its `main` not run); FOLDER is relative to the repository."""
    spec = importlib.util.spec_from_file_location(f"{folder.replace('/', '.')}.{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

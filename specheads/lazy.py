"""Package attributes that load on first use (PEP 562), so importing a light submodule stays light.

`specheads --help` must answer without torch, yet `from specheads.inference import Engine` should work: a
package whose names live in heavy submodules lists them here, and each is imported when first read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each name in `where` (name -> the module defining it) is
    imported on first use and kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__

"""Name -> entry tables that every list of names in the toolkit is derived from.

Five registries use this: drafter kinds in the core (`specheads.kinds.KINDS`), export formats and checkpoint
layouts (`specheads.formats.base.EXPORTERS`, `IMPORTERS`), training recipes (`specheads.train.objective.OBJECTIVES`)
and decoding methods (`specheads.inference.methods.METHODS`).
Each one fills itself on first use by importing one module whose imports register the built-in
entries, so a kind's files register themselves and no shared module lists them by name.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, in registration order; unknown names are refused with the known ones."""

    def __init__(self, what: str, builtins: str) -> None:
        """`what` names an entry in messages ("drafter kind"); `builtins` is the module whose import registers
        the built-in entries (imported lazily, so an entry's own module may import this registry)."""
        self.what = what
        self._builtins = builtins
        self._loaded = False
        self._entries: dict[str, T] = {}

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self._builtins)

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name`; registering a name twice is an error (two kinds cannot share a name)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered; pick another name")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Remove and return an entry (tests register toy kinds and take them out again)."""
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        self._load()
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown {self.what} {name!r}{hint}; choose one of: {', '.join(self._entries)}")
        return self._entries[name]

    def names(self) -> list[str]:
        self._load()
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        self._load()
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

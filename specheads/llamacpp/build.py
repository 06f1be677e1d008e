"""`llama-server` and llama.cpp's static libraries (which `tree_target.py` links) built from its source (`source.py`)
with cmake, once per version and CPU.

The binary is built for the CPU it runs on (`GGML_NATIVE`: AVX2, AVX-512, AMX where present), statically linked,
without the network client or the web UI; so it is cached per CPU too (a hash of the CPU's feature flags in the
folder name), and a cache shared between machines never hands one a binary it cannot run.
`SPECHEADS_LLAMACPP_CMAKE_ARGS` adds cmake options (e.g. `-DGGML_CUDA=ON` for an NVIDIA GPU), and is part of the
cache key as well. The server-side libraries compile in unity batches (`UNITY_TARGETS`): a build took 6.9 minutes on
a 2-core EPYC with AVX2 (11 CPU-minutes, against about 17.5 file by file); an interrupted one resumes where it stopped.
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
LIBRARIES = "lib"  # the static libllama and ggml archives (position independent), for `native.py`'s library
# what the cached folder holds; a new layout builds afresh rather than finding an old folder without its parts
LAYOUT = "server+static-libs-1"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
    "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",  # the static libraries link into the engine's shared library too
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no model downloads: models are local files here
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would fetch the web UI from the network
)
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
# The server's own libraries (HTTP, chat templates and their tool-call parsers, argument parsing, multimodal input):
# dozens of files that each parse the same large headers, and none of the kernels a token's decode spends its time
# in. Compiled in unity batches, as llama.cpp itself compiles its model graphs, they build in a fraction of the time;
# ggml and libllama compile file by file as upstream builds them.
UNITY_TARGETS = ("llama-common", "mtmd", "server-context", "llama-server-impl")
UNITY_BATCH = 8
# compiled on their own: they stop the build (#error) if they see mtmd's internal headers, as a batch would show them
UNITY_APART = ("mtmd-helper.cpp", "mtmd-helper-gen.cpp")
_UNITY_CMAKE = """\
# written by specheads: unity batches for llama.cpp's server-side libraries (specheads/llamacpp/build.py)
get_property(_specheads_deferred GLOBAL PROPERTY SPECHEADS_UNITY_DEFERRED)
if(NOT _specheads_deferred)
    set_property(GLOBAL PROPERTY SPECHEADS_UNITY_DEFERRED TRUE)
    set(_specheads_apart {apart})
    function(_specheads_unity)
        foreach(target {targets})
            if(TARGET ${{target}})
                set_target_properties(${{target}} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE {batch})
                get_target_property(dir ${{target}} SOURCE_DIR)
                get_target_property(sources ${{target}} SOURCES)
                foreach(source ${{sources}})
                    get_filename_component(name "${{source}}" NAME)
                    if(name IN_LIST _specheads_apart)
                        get_filename_component(path "${{source}}" ABSOLUTE BASE_DIR "${{dir}}")
                        set_source_files_properties("${{path}}" TARGET_DIRECTORY ${{target}}
                                                    PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
                    endif()
                endforeach()
            endif()
        endforeach()
    endfunction()
    cmake_language(DEFER DIRECTORY "${{CMAKE_SOURCE_DIR}}" CALL _specheads_unity)
endif()
"""


def extra_cmake_args() -> list[str]:
    return shlex.split(os.environ.get("SPECHEADS_LLAMACPP_CMAKE_ARGS", ""))


def machine_key() -> str:
    """What the native build depends on: the architecture, the CPU's feature flags, the extra cmake options."""
    flags = " ".join(cpu_flags()) or platform.processor()
    text = "\n".join([platform.machine(), flags, *extra_cmake_args(), LAYOUT])
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


def unity_options(build: Path) -> list[str]:
    """The cmake options that compile `UNITY_TARGETS` in unity batches: a script in `build` that cmake reads after
    each project() call (CMAKE_PROJECT_INCLUDE), and that sets the targets' properties once they all exist."""
    script = build / "specheads-unity.cmake"
    script.write_text(_UNITY_CMAKE.format(targets=" ".join(UNITY_TARGETS), batch=UNITY_BATCH,
                                          apart=" ".join(UNITY_APART)))
    return [f"-DCMAKE_PROJECT_INCLUDE={script}"]


def _build(version: str, dest: Path, report: Progress, jobs: int | None) -> None:
    check_toolchain()
    src = source_tree(version, report)
    build = llamacpp_home(version) / f"build-{machine_key()}"
    build.mkdir(parents=True, exist_ok=True)
    report(f"configuring llama.cpp {version} in {build}")
    _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS, *unity_options(build), *extra_cmake_args()],
         report, quiet=True)
    jobs = jobs or os.cpu_count() or 1
    report(f"building {SERVER} (llama.cpp {version}, {jobs} jobs; once per version and CPU)")
    _run(["cmake", "--build", str(build), "--config", "Release", "--target", SERVER, "-j", str(jobs)], report)
    built = next((p for p in (build / "bin" / SERVER, build / "bin" / "Release" / SERVER) if p.is_file()), None)
    if built is None:
        raise RuntimeError(f"the build finished but left no {SERVER} in {build / 'bin'}")
    libraries = dest / LIBRARIES
    libraries.mkdir()
    for archive in static_archives(build):
        shutil.copy2(archive, libraries / archive.name)
    shutil.copy2(built, dest / SERVER)
    shutil.rmtree(build, ignore_errors=True)  # hundreds of MB of objects: the binary is all that is kept
    report(f"built {SERVER} of llama.cpp {version}")


def static_archives(build: Path) -> list[Path]:
    """libllama and every ggml library of a finished build (the CPU backend's, and any other backend's the extra
    cmake options enabled), in link order: libllama first, ggml's base library last."""
    llama = build / "src" / "libllama.a"
    ggml = sorted((build / "ggml").rglob("libggml*.a"), key=lambda p: (p.name == "libggml-base.a", p.name))
    if not llama.is_file() or not ggml:
        raise RuntimeError(f"the build finished but left no libllama.a or libggml*.a under {build}")
    return [llama, *ggml]


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

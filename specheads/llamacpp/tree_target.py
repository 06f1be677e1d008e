"""libllama for the engine's llama.cpp backend: `tree_target.cpp` compiled against the pinned release's headers and
linked with its static libraries (`build.py` keeps them beside `llama-server`) into one shared library, cached per
version, CPU and source, and bound here with ctypes.

Two checks make a mismatch an error before the first call, never a crash:
- the C++ file includes llama.cpp's own headers, so a struct or signature that changed there fails its compile;
- every function the binding declares (`SIGNATURES`, in C types) is checked against the compiled definition by a
  `static_assert` compiled into the same library, and the library's ABI revision is checked when it is loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

from specheads.cached import cached_folder
from specheads.llamacpp.build import LIBRARIES, check_toolchain, llama_server, machine_key
from specheads.llamacpp.source import VERSION, Progress, llamacpp_home, quiet, source_tree

SOURCE = Path(__file__).with_name("tree_target.cpp")
LIBRARY = "libspecheads-tree-target.so"
ABI = 1  # tree_target.cpp's TT_ABI
# every function of tree_target.cpp the binding calls, as C declares it: (result, arguments)
SIGNATURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tt_abi": ("int32_t", ()),
    "tt_max_seq": ("int32_t", ()),
    "tt_last_log": ("void", ("char *", "int32_t")),
    "tt_open": ("tt_target *", ("const char *", "int32_t", "int32_t", "int32_t", "int32_t", "int32_t", "int32_t",
                                "char *", "int32_t")),
    "tt_close": ("void", ("tt_target *",)),
    "tt_n_vocab": ("int32_t", ("const tt_target *",)),
    "tt_n_embd": ("int32_t", ("const tt_target *",)),
    "tt_n_layer": ("int32_t", ("const tt_target *",)),
    "tt_n_ctx": ("int32_t", ("const tt_target *",)),
    "tt_n_ctx_train": ("int32_t", ("const tt_target *",)),
    "tt_keep_layer_input": ("void", ("tt_target *", "int32_t", "int32_t")),
    "tt_keep_final_hidden": ("void", ("tt_target *", "int32_t")),
    "tt_decode": ("int32_t", ("tt_target *", "int32_t", "const int32_t *", "const int32_t *", "const int32_t *",
                              "const int32_t *", "const int8_t *")),
    "tt_logits": ("int32_t", ("tt_target *", "int32_t", "const int32_t *", "float *")),
    "tt_final_hidden": ("int32_t", ("tt_target *", "int32_t", "const int32_t *", "float *")),
    "tt_layer_input": ("int32_t", ("tt_target *", "int32_t", "int32_t", "float *")),
    "tt_seq_rm": ("int32_t", ("tt_target *", "int32_t", "int32_t", "int32_t")),
    "tt_seq_cp": ("void", ("tt_target *", "int32_t", "int32_t", "int32_t", "int32_t")),
    "tt_seq_pos_max": ("int32_t", ("tt_target *", "int32_t")),
    "tt_clear": ("void", ("tt_target *",)),
    "tt_set_threads": ("void", ("tt_target *", "int32_t")),
}
# C types -> ctypes: pointers cross as plain addresses (arrays' data_ptr), strings as bytes
_CTYPES = {"void": None, "int32_t": ctypes.c_int32, "const char *": ctypes.c_char_p, "char *": ctypes.c_char_p}


def _ctype(c: str):
    return _CTYPES[c] if c in _CTYPES else ctypes.c_void_p


def signature_checks() -> str:
    """C++ that fails to compile unless every function in `SIGNATURES` has exactly the declared type."""
    lines = ["#include <type_traits>"]
    for name, (result, args) in SIGNATURES.items():
        lines.append(f"static_assert(std::is_same<decltype(&{name}), {result} (*)({', '.join(args)})>::value, "
                     f'"{name}: the binding (tree_target.py SIGNATURES) and tree_target.cpp disagree");')
    return "\n".join(lines) + "\n"


def library_key() -> str:
    """What the library depends on beyond the llama.cpp build: its source and the binding's declarations."""
    text = SOURCE.read_text() + repr(sorted(SIGNATURES.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def tree_target_library(version: str = VERSION, on_progress: Progress | None = None) -> Path:
    """The shared library, built on first use (llama.cpp's source and static libraries first, if needed)."""
    report = on_progress or quiet
    server = llama_server(version, report)
    folder = llamacpp_home(version) / f"tree-target-{machine_key()}-{library_key()}"
    cached_folder(folder, lambda tmp: _link(version, server.parent / LIBRARIES, tmp, report), marker=LIBRARY)
    return folder / LIBRARY


def _link(version: str, libraries: Path, dest: Path, report: Progress) -> None:
    check_toolchain()
    src = source_tree(version)
    archives = sorted(libraries.glob("*.a"), key=lambda p: (p.name != "libllama.a", p.name == "libggml-base.a"))
    if not any(p.name == "libllama.a" for p in archives):
        raise RuntimeError(f"{libraries} holds no libllama.a; remove {libraries.parent} so that llama.cpp builds again")
    unit = dest / "tree_target_checked.cpp"
    unit.write_text(f'#include "{SOURCE}"\n' + signature_checks())
    compiler = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), "c++")
    cmd = [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
           "-I", str(src / "include"), "-I", str(src / "ggml" / "include"), "-I", str(src / "src"),
           str(unit), "-o", str(dest / LIBRARY),
           "-Wl,--start-group", *map(str, archives), "-Wl,--end-group",
           "-fopenmp", "-lpthread", "-Wl,--no-undefined", "-Wl,--exclude-libs,ALL"]
    report(f"linking the engine's libllama ({LIBRARY}) against llama.cpp {version}")
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-25:])
        raise RuntimeError(f"compiling {SOURCE.name} against llama.cpp {version} failed (exit {done.returncode}): "
                           f"its headers or the binding's declarations disagree with it. The compiler's last "
                           f"lines:\n{tail}")
    unit.unlink()


@cache
def load(path: Path | None = None) -> ctypes.CDLL:
    """The library at `path` (default: built or found in the cache), its functions typed as `SIGNATURES` says."""
    path = path or tree_target_library()
    lib = ctypes.CDLL(str(path))
    for name, (result, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = _ctype(result)
        fn.argtypes = [_ctype(a) for a in args]
    if lib.tt_abi() != ABI:
        raise RuntimeError(f"{path} is revision {lib.tt_abi()} of the engine's libllama, the binding expects {ABI}; "
                           f"remove {path.parent} so that it is built again")
    return lib


def last_log(lib: ctypes.CDLL) -> str:
    """llama.cpp's errors and warnings since the last ask (cleared)."""
    buf = ctypes.create_string_buffer(8192)
    lib.tt_last_log(buf, len(buf))
    return buf.value.decode(errors="replace").strip()

"""llama.cpp's own converter (`convert_hf_to_gguf.py` of the pinned release) run on a HF model or drafter folder.

It runs in a child process of this Python, with the release's own `gguf-py` first on the path (the GGUF keys and
tensor kinds it writes are that release's, whatever `gguf` package is installed). It imports torch, numpy,
transformers, safetensors and sentencepiece (the last even for a BPE tokenizer).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from specheads.llamacpp.source import CONVERTER, VERSION, Progress, source_tree

# --outtype values the converter takes that we check: full precision, bf16, and 8-bit blocks
OUTTYPES = ("f32", "bf16", "q8_0")


def check_outtype(outtype: str) -> str:
    if outtype not in OUTTYPES:
        raise ValueError(f"GGUF precision {outtype!r} is not one of {', '.join(OUTTYPES)}; pass one of those")
    return outtype


def convert_hf_to_gguf(model_dir: str | Path, outfile: Path, *, outtype: str,
                       target_model_dir: str | Path | None = None, version: str = VERSION,
                       on_progress: Progress | None = None) -> Path:
    """Write `model_dir` as the GGUF `outfile` at `outtype`; a drafter (EAGLE-3) takes its tokenizer and layer
    count from `target_model_dir`. Raises with the converter's last lines when it fails."""
    check_outtype(outtype)
    if importlib.util.find_spec("sentencepiece") is None:
        raise RuntimeError("llama.cpp's converter imports sentencepiece (for every tokenizer); "
                           "pip install sentencepiece, then run again")
    src = source_tree(version, on_progress)
    cmd = [sys.executable, str(src / CONVERTER), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    if on_progress is not None:
        on_progress(f"converting {model_dir} to {outfile.name} with llama.cpp {version}'s converter")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    if done.returncode != 0 or not outfile.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir} (exit {done.returncode}):\n{tail}")
    return outfile

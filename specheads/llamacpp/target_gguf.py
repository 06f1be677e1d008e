"""A target as a GGUF file at a chosen precision, written once by llama.cpp's converter and cached.

`f32`, `bf16` and `q8_0` come from the target's HF folder (any model llama.cpp's converter takes; the default
target's is the safetensors folder `specheads.target` converts). `q4_1` is the default target's own file, the one
its package ships: the figure of a Q4_1 run used those very weights, not a re-quantization.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specheads.cached import cached_folder, stamp
from specheads.llamacpp.convert import OUTTYPES, convert_hf_to_gguf
from specheads.llamacpp.source import VERSION, Progress, llamacpp_home
from specheads.target import DEFAULT_TARGET_ALIASES, default_gguf_path, resolve_target

SHIPPED = "q4_1"  # the default target's bundled GGUF
PRECISIONS = (*OUTTYPES, SHIPPED)


def target_gguf(target: str, precision: str, *, version: str = VERSION, on_progress: Progress | None = None) -> Path:
    """The GGUF of `target` at `precision` (f32, bf16, q8_0; or q4_1, the default target's shipped file)."""
    is_default = target.strip().lower() in DEFAULT_TARGET_ALIASES
    if precision == SHIPPED:
        if not is_default:
            raise ValueError(f"{SHIPPED} is the default target's shipped GGUF only; for {target} use one of "
                             f"{', '.join(OUTTYPES)}")
        return default_gguf_path()
    if precision not in OUTTYPES:
        raise ValueError(f"GGUF precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    folder = resolve_target(target)
    if not Path(folder).is_dir():
        raise ValueError(f"target {target!r} is not a local folder; llama.cpp's converter reads local files only, "
                         "so download the model first and pass its folder")
    # the folder and its files' sizes and times: a model saved again over the same folder converts again
    key = hashlib.sha256(stamp(Path(folder).resolve()).encode()).hexdigest()[:10]
    name = f"{Path(folder).name}-{key}-{precision}"
    dest = cached_folder(llamacpp_home(version) / "targets" / name,
                         lambda tmp: convert_hf_to_gguf(folder, tmp / "model.gguf", outtype=precision,
                                                        version=version, on_progress=on_progress),
                         marker="model.gguf")
    return dest / "model.gguf"

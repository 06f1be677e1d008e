"""`specheads export`: a training run's heads (or any heads folder) written in a format another engine loads.

    hf           our own format plus a model card (README.md): what `--heads` and the Hub read
    speculators  vLLM's format (the `speculators` package), for eagle3 heads
    sglang       SGLang's, for eagle3 heads
    vllm-medusa  vLLM's Medusa layout, for medusa heads
    gguf         llama.cpp's, for eagle3 and peagle heads (`specheads.formats.gguf`), and for a target itself
                 (`export_target`): a model folder, or the default target, as the GGUF llama.cpp loads with -m

The output folder must be new or empty: an export never overwrites files it did not write.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from specheads.formats.base import ExportContext, exporter_for
from specheads.formats.card import model_card
from specheads.formats.engines import HF_FORMAT
from specheads.formats.load import read_heads
from specheads.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, Checkpoint
from specheads.target import DEFAULT_TARGET_ALIASES, DEFAULT_TARGET_HUB_ID, resolve_target


@dataclass(frozen=True)
class Exported:
    folder: Path
    format: str
    files: list[str]
    verifier: str


def heads_folder(run_or_heads: str | Path) -> Path:
    """A heads folder as is; a training run folder as its final/ heads (refused when the run has not finished)."""
    path = Path(run_or_heads)
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / "config.yaml").is_file() or (path / "checkpoints").is_dir():
        if not (path / "final" / CONFIG_NAME).is_file():
            raise ValueError(f"training run {path} has no finished heads (no final/{CONFIG_NAME}); let it finish "
                             "or resume it with resume=true, then export")
        return path / "final"
    raise ValueError(f"{path} is neither a heads folder (with {CONFIG_NAME}) nor a training run; pass a run's "
                     "output_dir or its final/ folder")


def _verifier(ckpt: Checkpoint, verifier: str | None) -> str:
    return verifier or _verifier_name(ckpt.target.name)


def _verifier_name(target: str) -> str:
    return DEFAULT_TARGET_HUB_ID if target.strip().lower() in DEFAULT_TARGET_ALIASES else target


def _fresh(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"output {folder} exists and is not an empty folder; pass a new --output folder")


def is_target(source: str | Path) -> bool:
    """Whether `source` names a target model rather than heads: the default target, or a model folder (a config
    without a drafter's keys, beside a tokenizer; no drafter folder carries one)."""
    if str(source).strip().lower() in DEFAULT_TARGET_ALIASES:
        return True
    folder = Path(source)
    if not (folder / CONFIG_NAME).is_file() or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return False
    meta = json.loads((folder / CONFIG_NAME).read_text())
    return not any(key in meta for key in _DRAFTER_KEYS)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_DRAFTER_KEYS = ("kind", "speculators_model_type", "draft_vocab_size", "medusa_num_heads")


def export_target(target: str, output: str | Path, precision: str | None = None) -> Exported:
    """The target `target` (the default target, or a model folder) as the GGUF llama.cpp loads, at `precision`
    (f32, bf16, q8_0; q4_1 is the default target's shipped file, copied as is), into the new folder `output`."""
    from specheads.formats.gguf import DEFAULT_PRECISION
    from specheads.llamacpp.convert import convert_hf_to_gguf
    from specheads.llamacpp.target_gguf import SHIPPED, target_gguf

    out = Path(output)
    _fresh(out)
    precision = precision or DEFAULT_PRECISION
    folder = Path(resolve_target(target))
    name = f"{folder.name}-{precision}.gguf"
    out.mkdir(parents=True, exist_ok=True)
    if precision == SHIPPED:
        shutil.copy2(target_gguf(target, SHIPPED), out / name)
    else:
        convert_hf_to_gguf(folder, out / name, outtype=precision)
    return Exported(out, "gguf", [name], _verifier_name(target))


def export(run_or_heads: str | Path, fmt: str, output: str | Path, *, target: str | None = None,
           verifier: str | None = None, speculative_tokens: int | None = None,
           precision: str | None = None) -> Exported:
    """Write the heads of `run_or_heads` as `fmt` into the new folder `output`.

    `target` (default: the one the heads were trained for) supplies the draft layers' config; `verifier` is the
    target's name written for the serving engine (default: the trained-for target, the default target's Hub id);
    `speculative_tokens` the draft depth recorded where `fmt` keeps one (default: the drafter's own, 3 for a
    chain drafter; a block drafter refuses more than its block, with a ValueError naming the fix); `precision`
    the GGUF export's tensor type (f32, the default, bf16 or q8_0). With `fmt` gguf, `run_or_heads` may name a
    target instead (`is_target`), exported as its own GGUF (`export_target`)."""
    if precision is not None and fmt != "gguf":
        raise ValueError(f"--outtype sets a GGUF export's precision; --to {fmt} writes the heads' own tensors, "
                         "so leave it out (or export --to gguf)")
    if fmt == "gguf" and is_target(run_or_heads):
        return export_target(str(run_or_heads), output, precision)
    source = heads_folder(run_or_heads)
    ckpt = read_heads(source)
    out = Path(output)
    _fresh(out)
    from transformers import AutoConfig

    target_path = resolve_target(target or ckpt.target.name)
    full_config = AutoConfig.from_pretrained(target_path)
    ctx = ExportContext(target_config=full_config.get_text_config(), verifier=_verifier(ckpt, verifier),
                        speculative_tokens=speculative_tokens, target_path=target_path,
                        verifier_architectures=tuple(full_config.architectures or ()), precision=precision)
    if fmt == HF_FORMAT:
        out.mkdir(parents=True, exist_ok=True)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copy2(source / name, out / name)
        run = source.parent if source.name == "final" else None
        (out / "README.md").write_text(model_card(ckpt, ctx, run), encoding="utf-8")
        files = [CONFIG_NAME, WEIGHTS_NAME, "README.md"]
    else:
        exporter = exporter_for(fmt, ckpt.kind)
        files = exporter.write(ckpt, out, ctx)
    if (out / CONFIG_NAME).exists() or fmt != "gguf":
        json.loads((out / CONFIG_NAME).read_text())  # every format's config must be valid JSON
    return Exported(out, fmt, files, ctx.verifier)

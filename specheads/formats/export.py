"""`specheads export`: a training run's heads (or any heads folder) written in a format another engine loads.

    hf           our own format plus a model card (README.md): what `--heads` and the Hub read
    speculators  vLLM's format (the `speculators` package), for eagle3 heads
    sglang       SGLang's, for eagle3 heads
    vllm-medusa  vLLM's Medusa layout, for medusa heads

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
    if verifier:
        return verifier
    if ckpt.target.name.strip().lower() in DEFAULT_TARGET_ALIASES:
        return DEFAULT_TARGET_HUB_ID
    return ckpt.target.name


def _fresh(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"output {folder} exists and is not an empty folder; pass a new --output folder")


def export(run_or_heads: str | Path, fmt: str, output: str | Path, *, target: str | None = None,
           verifier: str | None = None, speculative_tokens: int | None = None) -> Exported:
    """Write the heads of `run_or_heads` as `fmt` into the new folder `output`.

    `target` (default: the one the heads were trained for) supplies the draft layers' config; `verifier` is the
    target's name written for the serving engine (default: the trained-for target, the default target's Hub id);
    `speculative_tokens` the draft depth recorded where `fmt` keeps one (default: the drafter's own, 3 for a
    chain drafter; a block drafter refuses more than its block, with a ValueError naming the fix)."""
    source = heads_folder(run_or_heads)
    ckpt = read_heads(source)
    out = Path(output)
    _fresh(out)
    from transformers import AutoConfig

    target_path = resolve_target(target or ckpt.target.name)
    full_config = AutoConfig.from_pretrained(target_path)
    ctx = ExportContext(target_config=full_config.get_text_config(), verifier=_verifier(ckpt, verifier),
                        speculative_tokens=speculative_tokens, target_path=target_path,
                        verifier_architectures=tuple(full_config.architectures or ()))
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
    json.loads((out / CONFIG_NAME).read_text())  # every format's config must be valid JSON
    return Exported(out, fmt, files, ctx.verifier)

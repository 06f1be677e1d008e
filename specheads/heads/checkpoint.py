"""The checkpoint format shared by every drafter kind: one folder, two files.

    DIR/config.json        {"kind", "format_version", "config", "target", "metadata"}
    DIR/model.safetensors  the heads' own weights (frozen target weights they share are left out)

`kind` names the drafter kind (`specheads.kinds`), `config` holds exactly the fields of that
kind's config class, `target` records which target the heads were trained for (so loading them
onto a different target fails with a clear message instead of producing garbage drafts), and
`metadata` is informational (e.g. the last evaluation of the training run); no loader reads it.

`save_drafter` writes this format for every kind; `specheads.formats.load.load_heads` is the one way to load
heads (ours or another engine's), through `drafter_from_checkpoint`, which builds the module from a checkpoint
already read. It is strict: unknown config keys, missing or unexpected tensors and shape mismatches are refused by
name. Format 1 (before `metadata`) kept the training run's last evaluation as `config["eval"]`; it is read as
metadata. Formats 1 and 2 named the kind `head_type`. Both still load.

This module knows only our own format. Reading any heads folder (ours, another engine's layout, a Hub id) lives in
`specheads.formats.load`, which builds on this module: nothing here imports `specheads.formats`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specheads.config import build as build_config
from specheads.config import to_dict
from specheads.gemm_layout import linear_layout, set_linear_layout
from specheads.kinds import KINDS, kind_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_REQUIRED_KEYS = ("config", "target", "format_version")
_KIND_KEY = {1: "head_type", 2: "head_type", 3: "kind"}  # what each format calls the drafter kind
_V1_METADATA_KEYS = ("eval",)  # format 1 stored these inside `config`


@dataclass(frozen=True)
class TargetInfo:
    """What a checkpoint's heads depend on in their target."""

    name: str  # model id or path the heads were trained with (informational: one model can have many names)
    model_type: str  # HF config model_type, e.g. "llama"
    hidden_size: int
    vocab_size: int  # rows of the output embeddings, which can exceed the tokenizer's size
    num_layers: int | None  # None: not recorded (an imported foreign checkpoint); not checked then

    @classmethod
    def from_config(cls, config: Any, name: str) -> TargetInfo:
        """The target a HF config describes (a model's, or its text config); its vocabulary is `vocab_size`."""
        cfg = config.get_text_config()
        return cls(name=str(name), model_type=str(cfg.model_type), hidden_size=int(cfg.hidden_size),
                   vocab_size=int(cfg.vocab_size), num_layers=int(cfg.num_hidden_layers))

    @classmethod
    def from_model(cls, model: nn.Module, name: str) -> TargetInfo:
        # the heads score the output embeddings' rows, which a padded LM head makes more than config.vocab_size
        return replace(cls.from_config(model.config, name),
                       vocab_size=int(model.get_output_embeddings().weight.shape[0]))

    def describe(self) -> str:
        return f"hidden {self.hidden_size}, vocab {self.vocab_size}" + (
            "" if self.num_layers is None else f", {self.num_layers} layers")

    def check_sizes(self, other: TargetInfo, *, subject: str, fix: str, label: str = "heads") -> None:
        """Raise ValueError when the target `other` differs from this one (the target the heads were trained for)
        in a size the heads depend on: hidden size, vocabulary and, when both record it, layer count. The message
        starts with `subject` (e.g. "these heads were"), lists each differing size ("hidden size 576 (heads) vs 960
        (target)", `label` naming what was trained) and ends with `fix`."""
        sizes = {"hidden size": (self.hidden_size, other.hidden_size),
                 "vocabulary": (self.vocab_size, other.vocab_size)}
        if self.num_layers is not None and other.num_layers is not None:
            sizes["layers"] = (self.num_layers, other.num_layers)
        differ = [f"{what} {mine} ({label}) vs {theirs} (target)" for what, (mine, theirs) in sizes.items()
                  if mine != theirs]
        if differ:
            raise ValueError(f"{subject} trained for target {self.name} ({self.describe()}), not this target: "
                             f"{'; '.join(differ)}; {fix}")

    def check_compatible(self, model: nn.Module, name: str | None = None, *,
                         checkpoint: str | os.PathLike | None = None) -> None:
        """Raise ValueError when `model` differs in a size the heads depend on; warn on a mere name change."""
        where = f"heads in {checkpoint}" if checkpoint is not None else "these heads"
        self.check_sizes(TargetInfo.from_model(model, name or "this target"), subject=f"{where} were",
                         fix="train heads for this target or pass the matching --target")
        if name is not None and name != self.name:
            log.warning("%s were trained for target %s, now used with %s (same sizes; fine if it is the same model)",
                        where, self.name, name)

    @classmethod
    def from_dict(cls, data: dict, *, checkpoint: str | os.PathLike = "") -> TargetInfo:
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or any(k not in data for k in names):
            raise ValueError(f"checkpoint {checkpoint}: config.json 'target' must have the keys {names}, got {data!r}; "
                             "re-export or re-train it")
        return cls(**{k: data[k] for k in names})


def _atomic_write(folder: Path, final_name: str, write) -> Path:
    """Write through `write(tmp_path)` to a temp file in `folder`; return the temp path (caller renames it)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{final_name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def save_heads(path: str | os.PathLike, module: nn.Module, *, kind: str, config: dict, target: TargetInfo,
               exclude_prefixes: tuple[str, ...] = (), metadata: dict | None = None) -> None:
    """Write `module`'s weights and config to the folder `path` (created if needed).

    1. Collect the state dict minus keys under `exclude_prefixes` (e.g. a shared frozen target LM head).
    2. Write config.json and model.safetensors to temp files in the same folder (same file system,
       so the renames below are atomic) and fsync them.
    3. os.replace the weights, then the config: a crash leaves either the old or the new file
       under each name, never a half-written one.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()
             if not k.startswith(tuple(exclude_prefixes))}
    if not state:
        raise ValueError(f"nothing to save for {kind} heads: every weight matches exclude_prefixes={exclude_prefixes}")
    meta = {"kind": kind, "format_version": FORMAT_VERSION, "config": config, "target": asdict(target),
            "metadata": dict(metadata or {})}
    text = json.dumps(meta, indent=2) + "\n"  # serialise first: a non-JSON config fails before any file is touched

    def write_json(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    weights_tmp = _atomic_write(folder, WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    try:
        config_tmp = _atomic_write(folder, CONFIG_NAME, write_json)
    except BaseException:
        weights_tmp.unlink()
        raise
    os.replace(weights_tmp, folder / WEIGHTS_NAME)
    os.replace(config_tmp, folder / CONFIG_NAME)
    log.info("saved %s heads (%d tensors) to %s", kind, len(state), folder)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder as read from disk, before any module is built."""

    path: Path
    kind: str  # the drafter kind (`specheads.kinds`)
    config: dict
    target: TargetInfo
    state: dict[str, torch.Tensor]  # on CPU
    metadata: dict


def read_config(folder: Path) -> Any:
    """The parsed config.json of a heads folder, ours or another engine's; ValueError naming the fix when the
    folder or the file is missing or is not JSON."""
    if not folder.is_dir():
        raise ValueError(f"heads checkpoint {folder} does not exist or is not a folder; pass the folder that "
                         f"holds {CONFIG_NAME} and {WEIGHTS_NAME} (a training run's output)")
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(f"checkpoint {folder} has no {CONFIG_NAME}; it is incomplete or not a heads checkpoint: "
                         "re-export or re-train it")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint {folder} is corrupt ({CONFIG_NAME}: {err}); re-export or re-train it") from err


def checkpoint_from_config(folder: Path, meta: Any) -> Checkpoint:
    """Our checkpoint in `folder`, whose config.json parsed to `meta`: its keys checked, its weights read."""
    if not isinstance(meta, dict) or any(k not in meta for k in _REQUIRED_KEYS):
        missing = [k for k in _REQUIRED_KEYS if not isinstance(meta, dict) or k not in meta]
        raise ValueError(f"checkpoint {folder}: {CONFIG_NAME} lacks {missing}; re-export or re-train it")
    version = meta["format_version"]
    if version not in READABLE_VERSIONS:
        raise ValueError(f"checkpoint {folder} has format_version {version}, this specheads reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade specheads or re-export the checkpoint")
    if _KIND_KEY[version] not in meta:
        raise ValueError(f"checkpoint {folder}: {CONFIG_NAME} of format {version} lacks {[_KIND_KEY[version]]}; "
                         "re-export or re-train it")
    if not isinstance(meta["config"], dict):
        raise ValueError(f"checkpoint {folder}: {CONFIG_NAME} 'config' must be an object; re-export or re-train it")
    config, metadata = dict(meta["config"]), meta.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"checkpoint {folder}: {CONFIG_NAME} 'metadata' must be an object; re-export or re-train it")
    if version == 1:
        metadata = {**{k: config.pop(k) for k in _V1_METADATA_KEYS if k in config}, **metadata}
    target = TargetInfo.from_dict(meta["target"], checkpoint=folder)
    weights_file = folder / WEIGHTS_NAME
    if not weights_file.is_file():
        raise ValueError(f"checkpoint {folder} has no {WEIGHTS_NAME}; it is incomplete: re-export or re-train it")
    try:
        state = load_file(weights_file, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"checkpoint {folder} is corrupt or truncated ({WEIGHTS_NAME}: {err}); "
                         "re-export or re-train it") from err
    return Checkpoint(folder, str(meta[_KIND_KEY[version]]), config, target, state, metadata)


def is_ours(meta: dict) -> bool:
    """Whether a folder's config.json is our checkpoint format (any version) rather than another engine's."""
    return "format_version" in meta and any(key in meta for key in set(_KIND_KEY.values()))


def save_drafter(path: str | os.PathLike, module: nn.Module, target: TargetInfo, *, config: Any = None,
                 metadata: dict | None = None) -> None:
    """Save a drafter of any registered kind: its config (`config`, default `module.config`), its own weights
    (not the target's shared ones) and informational `metadata`."""
    kind = kind_of(module)
    config = module.config if config is None else config
    if not isinstance(config, kind.config):
        raise TypeError(f"{kind.name} heads save a {kind.config.__name__}, got {type(config).__name__}")
    save_heads(path, module, kind=kind.name, config=to_dict(config), target=target,
               exclude_prefixes=kind.shared_prefixes, metadata=metadata)


def drafter_from_checkpoint(ckpt: Checkpoint, target_model: nn.Module, *, kind: str | None = None,
                            target_name: str | None = None) -> nn.Module:
    """The drafter `ckpt` holds (ours or an imported one), built for `target_model` on its device, in eval mode.

    1. The kind is the checkpoint's `kind` (when `kind` is given, it must match).
    2. Check the target has the sizes the heads were trained for.
    3. Build the kind's config strictly: an unknown key is refused with the nearest known one.
    4. Build the module and compare its state dict (minus the target's shared weights) with the file:
       missing or unexpected tensors and shape mismatches are refused by name, with both shapes.
    5. Load the weights (cast to the module's dtype), move the module to the target's device and store its
       linear weights in the target's layout (`gemm_layout.py`), which suits the same few-row products.
    """
    if ckpt.kind not in KINDS:
        raise ValueError(f"checkpoint {ckpt.path} holds {ckpt.kind!r} heads, a kind this specheads does not know "
                         f"({', '.join(KINDS.names())}); upgrade specheads or use a checkpoint of a known kind")
    if kind is not None and ckpt.kind != kind:
        raise ValueError(f"checkpoint {ckpt.path} holds {ckpt.kind!r} heads, not {kind} heads; "
                         f"use the method that matches it (--method {ckpt.kind})")
    spec = KINDS.get(ckpt.kind)
    ckpt.target.check_compatible(target_model, target_name, checkpoint=ckpt.path)
    try:
        config = build_config(spec.config, ckpt.config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {ckpt.path}: bad {spec.name} config ({err}); re-export or re-train it") from None
    module = spec.build(config, target_model)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.startswith(spec.shared_prefixes)}
    check_state(ckpt.state, expected, f"checkpoint {ckpt.path}")
    module.load_state_dict(ckpt.state, strict=False)
    module = module.to(next(target_model.parameters()).device).eval()
    return set_linear_layout(module, linear_layout(target_model))


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse `state` unless it has exactly the `expected` tensor names and shapes; the error names them."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where} does not match the heads its config builds (missing tensors {missing[:4]}, "
                         f"unexpected tensors {unexpected[:4]}); re-export or re-train it")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(state[name].shape)} in the file but "
                             f"{shape} in the heads its config builds; re-export or re-train it")

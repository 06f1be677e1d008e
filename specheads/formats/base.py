"""Other engines' checkpoint formats: exporters write a drafter in them, importers read one back as ours.

An `Exporter` turns one of our checkpoints of one kind into the files a serving engine loads (`--to FORMAT`);
an `Importer` recognises a foreign folder by its config and tensor names and converts it into our
`Checkpoint` in memory, so everything that loads heads (`load.load_heads`, hence `--heads`) reads it
unchanged, through the same strict shape checks. Each drafter kind registers its formats from its own file here.

Every export is checked on write against the names and shapes the engine's loader reads (`check_export`):
a missing tensor, a wrong shape, or a tensor the loader would silently drop is refused by name.
"""

from __future__ import annotations

import functools
import json
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specheads.draft_layers import head_layer_config
from specheads.formats.engines import FORMATS, HF_FORMAT
from specheads.heads.checkpoint import Checkpoint, TargetInfo
from specheads.registry import Registry


@dataclass(frozen=True)
class ExportContext:
    """What an exporter knows besides the checkpoint."""

    target_config: Any  # the target's HF text config (a PretrainedConfig): sizes and architecture of the draft layers
    verifier: str  # the target's name for the serving engine: a Hub id or a path it can read
    # Draft depth written where a format records one; None: the format's own (a chain drafter's 3, a block
    # drafter's block). A block drafter's format refuses more than its block (`speculators.block_speculative_tokens`).
    speculative_tokens: int | None = None
    target_path: str | None = None  # the target's local folder, for formats that carry some of its weights
    # The target's own model classes, from its top-level config: an image-text target's (Gemma 3's
    # Gemma3ForConditionalGeneration), which its text config does not name. The engines load the verifier as these.
    verifier_architectures: tuple[str, ...] = ()
    precision: str | None = None  # the GGUF export's tensor type (f32, bf16, q8_0); None: the format's default

    def target_lm_head(self) -> torch.Tensor:  # [V, H]: the target's output embedding, read from its files
        return _target_weights(self._need_path())[1]

    def target_embedding(self) -> torch.Tensor:  # [V, H]: the target's input embedding
        return _target_weights(self._need_path())[0]

    def _need_path(self) -> str:
        if self.target_path is None:
            raise ValueError("this export needs some of the target's weights; "
                             "pass --target with a local folder or Hub id")
        return self.target_path


@functools.lru_cache(maxsize=1)
def _target_weights(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoConfig

    from specheads.hf import causal_lm_class

    model = causal_lm_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


@dataclass(frozen=True)
class Exporter:
    format: str  # `specheads export --to FORMAT`
    kind: str  # the drafter kind it writes
    loader: str  # what reads the result, for messages and the model card
    # (checkpoint, output folder, context) -> the file names written; a ValueError naming the fix when it cannot
    write: Callable[[Checkpoint, Path, ExportContext], list[str]]
    serve: str = ""  # the command that serves an export in DIR, with {verifier}: for the model card


@dataclass(frozen=True)
class Importer:
    layout: str  # a name for messages, e.g. "speculators eagle3"
    needs: str  # what identifies the layout, for the message when nothing matches
    detect: Callable[[Mapping[str, Any], set[str]], bool]  # (config.json, tensor names) -> whether it is this layout
    # (folder, config.json, tensors, target layer count or None) -> our checkpoint
    read: Callable[[Path, Mapping[str, Any], dict[str, torch.Tensor], int | None], Checkpoint]


EXPORTERS: Registry[Exporter] = Registry("export format", builtins="specheads.formats.builtin")
IMPORTERS: Registry[Importer] = Registry("checkpoint layout", builtins="specheads.formats.builtin")


def register_exporter(exporter: Exporter) -> Exporter:
    if exporter.format not in FORMATS or exporter.format == HF_FORMAT:
        raise ValueError(f"export format {exporter.format!r} is not declared; add it, with what loads it, to "
                         "specheads.formats.engines.FORMATS (hf is written for every kind already)")
    return EXPORTERS.register(f"{exporter.format}/{exporter.kind}", exporter)


def register_importer(importer: Importer) -> Importer:
    return IMPORTERS.register(importer.layout, importer)


def export_formats() -> list[str]:
    """Every `--to` name, in registration order."""
    return list(dict.fromkeys(e.format for _, e in EXPORTERS.items()))


def exporter_for(fmt: str, kind: str) -> Exporter:
    """The exporter writing `kind` heads as `fmt`; a ValueError naming the formats that can, when none does."""
    key = f"{fmt}/{kind}"
    if key in EXPORTERS:
        return EXPORTERS.get(key)
    if fmt not in export_formats():
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join([HF_FORMAT, *export_formats()])}")
    able = [HF_FORMAT] + [e.format for _, e in EXPORTERS.items() if e.kind == kind]
    raise ValueError(f"--to {fmt} cannot express {kind} heads ({fmt} has no such drafter type); "
                     f"{kind} heads export to: {', '.join(able)}")


def import_folder(folder: Path, meta: Mapping[str, Any], num_target_layers: int | None = None) -> Checkpoint:
    """A foreign checkpoint folder as our Checkpoint; a ValueError naming what was looked for when no layout fits."""
    state = read_weights(folder)
    for _, importer in IMPORTERS.items():
        if importer.detect(meta, set(state)):
            return importer.read(folder, meta, state, num_target_layers)
    known = "; ".join(f"{i.layout} ({i.needs})" for _, i in IMPORTERS.items())
    raise ValueError(f"{folder} holds no drafter layout specheads reads: its config.json has no 'kind' (our "
                     f"format) and matches none of: {known}. "
                     "Pass a specheads training run's final/ folder or one of those")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF-style folder: model.safetensors, sharded *.safetensors with an index, or pickled
    .bin/.pt files read with torch.load(weights_only=True) (never arbitrary pickles)."""
    files = sorted(folder.glob("*.safetensors"))
    pickled = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
    if not files and not pickled:
        raise ValueError(f"{folder} has no weights (*.safetensors, *.bin or *.pt); it is incomplete")
    state: dict[str, torch.Tensor] = {}
    for path in files or pickled:
        try:
            part = load_file(path, device="cpu") if path.suffix == ".safetensors" else \
                torch.load(path, map_location="cpu", weights_only=True)
        except (SafetensorError, OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
            raise ValueError(f"{path} is corrupt or not plain tensors ({str(err).splitlines()[0]}); "
                             "re-download it") from None
        if not isinstance(part, dict):
            raise ValueError(f"{path} does not hold a dict of tensors; re-download it")
        state.update(part)
    return state


def check_export(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], loader: str) -> None:
    """Refuse an export unless it has exactly the tensors `loader` reads, with their shapes."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"export for {loader} lacks tensors {missing[:4]} that its loader reads")
    if extra:
        raise ValueError(f"export for {loader} has tensors {extra[:4]} that its loader would silently drop")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"export for {loader}: tensor {name!r} has shape {tuple(state[name].shape)}, its loader "
                             f"expects {tuple(shape)}")


def write_folder(folder: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> list[str]:
    """config.json and model.safetensors in `folder` (created); returns the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"  # serialise first: a bad config touches no file
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "config.json").write_text(text, encoding="utf-8")
    return ["config.json", "model.safetensors"]


# Layer types the engines build as Llama's: speculators builds draft layers of Llama's and Qwen3's types only
# (speculators/models/eagle3/model_definitions.py, model_classes), SGLang Llama's. A Mistral layer is a Llama layer:
# its window is a mask setting, and a head attends over its whole prefix (its masks are causal, never windowed).
WRITTEN_AS_LLAMA = ("mistral",)


def layer_config_dict(target_config: Any, num_layers: int, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`layer_config` as the dict an export writes (a Mistral layer's as the Llama layer it is)."""
    data = layer_config(target_config, num_layers, overrides).to_dict()
    data = {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
    if data["model_type"] in WRITTEN_AS_LLAMA:
        data.pop("sliding_window", None)
        data |= {"model_type": "llama", "attention_bias": False, "mlp_bias": False}
    return data


def layer_config(target_config: Any, num_layers: int, overrides: Mapping[str, Any]) -> Any:
    """The HF config of a draft head's layers (`draft_layers.head_layer_config`: the target's, or Llama's of its
    sizes, cut to the head's depth, with the head's own layer settings)."""
    return head_layer_config(target_config, num_layers, dict(overrides))


def foreign_target(name: Any, hidden_size: int, vocab_size: int, model_type: Any = "") -> TargetInfo:
    """What a foreign checkpoint tells of its target: no depth (the loader then checks hidden size and vocabulary)."""
    return TargetInfo(name=str(name or "unknown"), model_type=str(model_type or ""), hidden_size=int(hidden_size),
                      vocab_size=int(vocab_size), num_layers=None)


def layer_shapes(prefix: str, lc: Any, *, input_width: int, input_norm: bool = True,
                 qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of one Llama-style decoder layer whose q/k/v read `input_width` columns (with per-head q/k
    norms, Qwen3's, where `qk_norm`)."""
    h = lc.hidden_size
    hd = getattr(lc, "head_dim", None) or h // lc.num_attention_heads
    q, kv, inter = lc.num_attention_heads * hd, lc.num_key_value_heads * hd, lc.intermediate_size
    shapes = {f"{prefix}self_attn.q_proj.weight": (q, input_width),
              f"{prefix}self_attn.k_proj.weight": (kv, input_width),
              f"{prefix}self_attn.v_proj.weight": (kv, input_width), f"{prefix}self_attn.o_proj.weight": (h, q),
              f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
              f"{prefix}mlp.down_proj.weight": (h, inter), f"{prefix}post_attention_layernorm.weight": (h,)}
    if input_norm:
        shapes[f"{prefix}input_layernorm.weight"] = (h,)
    if qk_norm:
        shapes |= {f"{prefix}self_attn.q_norm.weight": (hd,), f"{prefix}self_attn.k_norm.weight": (hd,)}
    return shapes

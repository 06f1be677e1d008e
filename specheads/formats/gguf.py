"""Fused chain heads as the GGUF llama.cpp drafts with (`llama-server -md FILE --spec-type draft-eagle3`); the
kinds whose heads hold an EAGLE-3 draft register their `gguf` exporter through `write_chain_gguf` (eagle3's and
peagle's format files).

The heads go through llama.cpp's own converter (`specheads.llamacpp.convert`), from the speculators layout it reads
(`Eagle3Speculator`), with `--target-model-dir` giving it the target's tokenizer; what it wrote is then read back
and checked against the heads (`check_drafter_gguf`). llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) is one
Llama decoder layer over [norm(embedding), norm(fc(three target layer inputs))], a final norm, the draft LM head and
`d2t`; so these are refused by name before the converter runs: more or fewer than one layer or three aux layers,
`fc_norm`, `norm_output`, per-head q/k norms (a Qwen3 layer), biases, an activation other than SiLU, and a target
other than the one the heads were trained for (its sizes, or aux layer ids past its layers).

Block drafters (DFlash, DSpark) have no exporter here: llama.cpp's block drafters are written for Qwen3 backbones
and their own checkpoint layouts, so `--to gguf` refuses them, naming the formats that take them.

The target's token embedding is left out: llama.cpp's EAGLE-3 draft shares the target's (`-m`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specheads.features import check_aux_layers
from specheads.formats.base import ExportContext, Exporter, layer_config
from specheads.formats.speculators import write_speculators_layout
from specheads.heads.checkpoint import Checkpoint, TargetInfo
from specheads.heads.fused_chain import FusedChainConfig
from specheads.llamacpp.convert import check_outtype, convert_hf_to_gguf

GGUF_FORMAT = "gguf"
SPEC_TYPE = "draft-eagle3"  # llama-server's --spec-type for the draft
ARCHITECTURE = SPEC_TYPE.removeprefix("draft-")  # the draft's general.architecture: llama.cpp's own name for it
DEFAULT_PRECISION = "f32"


def exporter(kind: str, write: Callable[[Checkpoint, Path, ExportContext], list[str]]) -> Exporter:
    """The `gguf` exporter of a kind whose heads hold an EAGLE-3 draft; `write` calls `write_chain_gguf`."""
    return Exporter(GGUF_FORMAT, kind, f"llama.cpp ({SPEC_TYPE})", write,
                    serve=f"llama-server -m TARGET.gguf -md DIR/{gguf_name(kind, DEFAULT_PRECISION)} "
                          f"--spec-type {SPEC_TYPE}")


def gguf_name(kind: str, precision: str) -> str:
    return f"{kind}-{precision}.gguf"


def refuse_unrepresentable(cfg: FusedChainConfig, lc: Any, kind: str) -> None:
    """A ValueError naming what of these heads llama.cpp's EAGLE-3 graph cannot compute, if anything."""
    why = []
    if cfg.num_layers != 1:
        why.append(f"{cfg.num_layers} decoder layers (its draft has one)")
    if len(cfg.aux_layers) != 3:
        why.append(f"{len(cfg.aux_layers)} aux layers (it fuses exactly three)")
    why += [f"{flag} set (its graph has no such norm)" for flag in ("fc_norm", "norm_output") if getattr(cfg, flag)]
    if lc.model_type not in ("llama", "mistral") or getattr(lc, "q_norm", None):
        why.append(f"{lc.model_type} draft layers (it builds Llama layers: no per-head q/k norms)")
    why += [f"{flag} (its layer has no biases)" for flag in ("attention_bias", "mlp_bias") if getattr(lc, flag, False)]
    if getattr(lc, "hidden_act", "silu") != "silu":
        why.append(f"hidden_act {lc.hidden_act} (its MLP is SiLU-gated)")
    if why:
        raise ValueError(f"llama.cpp's EAGLE-3 draft cannot express these {kind} heads: {'; '.join(why)}; export "
                         "them with --to speculators for vLLM instead")


def refuse_other_target(mine: TargetInfo, ctx: ExportContext, cfg: FusedChainConfig) -> None:
    """The target named for the export must be the one the heads (trained for `mine`) were, in every size they
    read, and hold the layers they fuse."""
    tc = ctx.target_config
    mine.check_sizes(TargetInfo.from_config(tc, "this target"), subject="these heads were",
                     fix="pass the target they were trained for with --target")
    check_aux_layers(cfg.aux_layers, int(tc.num_hidden_layers))


def write_chain_gguf(cfg: FusedChainConfig, state: Mapping[str, torch.Tensor], folder: Path, ctx: ExportContext,
                     *, kind: str, target: TargetInfo, note: str = "", draft_max: int | None = None,
                     heads: Path | None = None) -> list[str]:
    """Write the EAGLE-3 draft of fused chain heads (`cfg`, their tensors `state` under speculators' names, trained
    for `target`) as `folder/KIND-PRECISION.gguf`, checked, and a README.md with the command that serves it (`note`
    and `draft_max`, the `--spec-draft-n-max` it recommends, from the kind), and the drafting settings measured for
    the heads in folder `heads` on this machine (`specheads.llamacpp.draft_settings`), where any were."""
    precision = check_outtype(ctx.precision or DEFAULT_PRECISION)
    lc = layer_config(ctx.target_config, cfg.num_layers, cfg.layer)
    refuse_unrepresentable(cfg, lc, kind)
    refuse_other_target(target, ctx, cfg)
    if ctx.target_path is None or not Path(ctx.target_path).is_dir():
        raise ValueError("llama.cpp's converter reads the target's tokenizer from a local folder; pass --target "
                         "with the target's folder")
    name = gguf_name(kind, precision)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / f"{kind}-draft"  # the converter names the model (general.name) after its folder
        # without the target's embedding: the draft shares the target's (`-m`)
        write_speculators_layout(cfg, state, draft, ctx, architecture="Eagle3Speculator", with_embedding=False)
        convert_hf_to_gguf(draft, folder / name, outtype=precision, target_model_dir=ctx.target_path)
    check_drafter_gguf(folder / name, cfg, lc)
    measured = _measured_settings(Path(heads), kind) if heads is not None else ""
    (folder / "README.md").write_text(_readme(kind, name, ctx.verifier, precision, note, draft_max) + measured,
                                      encoding="utf-8")
    return [name, "README.md"]


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], np.ndarray]]]:
    """(metadata, {tensor: (shape in PyTorch's order, data)}) of a GGUF file, through the `gguf` package."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    # GGUF lists dimensions fastest first; PyTorch's order is the reverse
    tensors = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.data) for t in reader.tensors}
    return meta, tensors


def check_drafter_gguf(path: Path, cfg: FusedChainConfig, lc: Any) -> None:
    """What llama.cpp reads from the file is what the heads are: architecture, layer ids, sizes, the vocabulary
    mapping, the target's tokenizer; a RuntimeError naming the first difference."""
    meta, tensors = read_gguf(path)
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    arch = meta.get("general.architecture")
    expected: Mapping[str, Any] = {
        "general.architecture": ARCHITECTURE,
        f"{arch}.block_count": 1,
        f"{arch}.target_layers": list(cfg.aux_layers),
        f"{arch}.target_hidden_size": h,
        f"{arch}.embedding_length": h,
        f"{arch}.norm_before_residual": bool(cfg.norm_before_residual),
        f"{arch}.norm_before_fc": bool(cfg.norm_before_fc),
    }
    for key, want in expected.items():
        got = meta.get(key)
        if (list(got) if isinstance(got, (list, tuple)) else got) != want:
            raise RuntimeError(f"{path.name}: {key} is {got!r}, not {want!r}: llama.cpp's converter wrote other "
                               "heads than these; nothing should load this file")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if not 0 < len(tokens) <= cfg.vocab_size:
        raise RuntimeError(f"{path.name}: its vocabulary has {len(tokens)} tokens, the target's LM head "
                           f"{cfg.vocab_size}: it was converted with another target's tokenizer")
    head_dim = getattr(lc, "head_dim", None) or h // lc.num_attention_heads
    shapes = {"fc.weight": (h, n * h), "output.weight": (cfg.draft_vocab_size, h), "output_norm.weight": (h,),
              "blk.0.attn_norm.weight": (h,), "blk.0.attn_norm_2.weight": (h,),
              "blk.0.attn_q.weight": (lc.num_attention_heads * head_dim, 2 * h)}
    for name, shape in shapes.items():
        if name not in tensors or tensors[name][0][-len(shape):] != shape:
            got = tensors[name][0] if name in tensors else "absent"
            raise RuntimeError(f"{path.name}: tensor {name} is {got}, not {shape}")
    if "token_embd.weight" in tensors:
        raise RuntimeError(f"{path.name} carries a token embedding of its own; the draft must share the target's")
    if cfg.draft_vocab is None:
        if "d2t" in tensors:
            raise RuntimeError(f"{path.name} has a d2t mapping but the heads score the whole vocabulary")
        return
    if "d2t" not in tensors:
        raise RuntimeError(f"{path.name} has no d2t: llama.cpp would read its {cfg.draft_vocab_size} LM head rows as "
                           "the first target ids")
    d2t = np.asarray(tensors["d2t"][1]).reshape(-1).tolist()
    if d2t != list(cfg.draft_vocab):
        first = next(i for i, (a, b) in enumerate(zip(d2t, cfg.draft_vocab)) if a != b) if len(d2t) == len(
            cfg.draft_vocab) else min(len(d2t), len(cfg.draft_vocab))
        raise RuntimeError(f"{path.name}: d2t maps draft row {first} elsewhere than the heads' draft vocabulary "
                           f"({len(d2t)} rows against {len(cfg.draft_vocab)})")


def _measured_settings(heads: Path, kind: str) -> str:
    """The README's section on the drafting settings measured for these heads here, one command per target file;
    how to measure them where none were."""
    from specheads.llamacpp.draft_settings import cached_choices, drafter_id

    choices = cached_choices(drafter_id(heads))
    if not choices:
        return ("\nNo drafting settings were measured for these heads on this machine. `specheads bench --methods "
                f"llamacpp,llamacpp+{kind}:HEADS_DIR` measures them against the target's GGUF (one server per setting: "
                "chain length, the drafter's probability cut and its precision), keeps the choice and reports it.\n")
    lines = ["", "## Drafting settings measured for these heads", ""]
    for c in choices:
        s = c.settings
        command = (f"llama-server -m TARGET.gguf -md {gguf_name(kind, s.precision)} --spec-type {SPEC_TYPE} "
                   f"{s.server_args()}" if s.n_max else "llama-server -m TARGET.gguf   # no draft")
        lines += [f"- target {c.target} on {c.machine}, {c.measured}: {c.why}.", "",
                  f"  ```bash\n  {command}\n  ```", ""]
    return "\n".join(lines)


def _readme(kind: str, name: str, verifier: str, precision: str, note: str, draft_max: int | None) -> str:
    depth = f" --spec-draft-n-max {draft_max}" if draft_max else ""
    return (f"# {kind} heads for llama.cpp ({precision})\n\n"
            f"An EAGLE-3 draft for {verifier}, in the GGUF file llama.cpp loads with `-md`. Serve it beside the "
            f"target's own GGUF (`specheads export TARGET_DIR --to gguf` writes one; `default` for the default "
            f"target):\n\n"
            f"```bash\nllama-server -m TARGET.gguf -md {name} --spec-type {SPEC_TYPE}{depth}\n```\n"
            + (f"\n{note}\n" if note else ""))



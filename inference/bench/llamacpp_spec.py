"""How `specheads bench --methods` names a llama.cpp method, parsed and checked without torch (the runner is
`specheads.inference.bench.llamacpp`):

    llamacpp                       the target's GGUF at the run's precision (f32 for --dtype float32, bf16 for bf16)
    llamacpp@q4_1                  another precision: f32, bf16, q8_0, or q4_1 (the default target's shipped file)
    llamacpp+eagle3:DIR            with EAGLE-3 heads (a run, a heads folder, or a .gguf written by export --to gguf)
    llamacpp+peagle:DIR@q4_1       P-EAGLE heads as llama.cpp's EAGLE-3 draft, against the Q4_1 target
    llamacpp+eagle3:DIR+draft_max=5   llama.cpp's --spec-draft-n-max (default 3)
    llamacpp+ngram-mod             llama.cpp's own training-free drafting (`TRAINING_FREE`: ngram-simple, ngram-mod,
                                   ngram-map-k, ngram-map-k4v, ngram-cache), at any precision, with +draft_max=N
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

METHOD = "llamacpp"
PRECISIONS = ("f32", "bf16", "q8_0", "q4_1")
DEFAULT_DRAFT_MAX = 3  # llama.cpp's own default --spec-draft-n-max
# llama.cpp's own drafters that need no model (its --spec-type values): what a llama.cpp user tries first
TRAINING_FREE = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
_DRAFT_MAX = re.compile(r"\+draft_max=(\d+)$")
_PRECISION = re.compile(r"@([a-z0-9_]+)$")
# an engine method on llama.cpp's kernels (`+backend=llamacpp`, method_spec.py) and its target GGUF's precision
_ON_LLAMACPP = re.compile(r"\+backend=llamacpp(?=\+|$)")
_GGUF = re.compile(r"\+gguf=([a-z0-9_]+)(?=\+|$)")


@dataclass(frozen=True)
class LlamaCppOptions:
    kind: str | None = None  # the drafter's kind, or one of llama.cpp's own (`TRAINING_FREE`); None: plain decoding
    heads: str | None = None  # its run, heads folder or .gguf file (None for llama.cpp's own)
    precision: str | None = None  # the target GGUF's; None: the run's dtype (f32 or bf16)
    draft_max: int = DEFAULT_DRAFT_MAX


def is_llamacpp(name: str) -> bool:
    return name == METHOD or name.startswith((f"{METHOD}+", f"{METHOD}@"))


def parse_llamacpp(name: str) -> LlamaCppOptions:
    """`llamacpp[+KIND:DIR][@PRECISION][+draft_max=N]`, checked before anything loads."""
    rest = name[len(METHOD):]
    draft_max = DEFAULT_DRAFT_MAX
    if m := _DRAFT_MAX.search(rest):
        draft_max, rest = int(m[1]), rest[: m.start()]
        if draft_max < 1:
            raise ValueError(f"{name}: +draft_max= is the most tokens llama.cpp drafts per step, >= 1")
    precision = None
    if m := _PRECISION.search(rest):
        precision, rest = m[1], rest[: m.start()]
        if precision not in PRECISIONS:
            raise ValueError(f"{name}: llama.cpp precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not rest:
        if draft_max != DEFAULT_DRAFT_MAX:
            raise ValueError(f"{name}: +draft_max= needs a drafter: {METHOD}+KIND:DIR+draft_max={draft_max}")
        return LlamaCppOptions(precision=precision)
    kind, _, heads = rest.removeprefix("+").partition(":")
    if rest.startswith("+") and kind in TRAINING_FREE and not heads:
        return LlamaCppOptions(kind=kind, precision=precision, draft_max=draft_max)
    if not rest.startswith("+") or not kind or not heads:
        raise ValueError(f"{name}: write {METHOD}, {METHOD}@PRECISION, {METHOD}+KIND:DIR[@PRECISION][+draft_max=N] "
                         "(KIND: a drafter kind whose heads export --to gguf) or "
                         f"{METHOD}+MODE[@PRECISION][+draft_max=N] (MODE: one of llama.cpp's own "
                         f"{', '.join(TRAINING_FREE)})")
    if not Path(heads).exists():
        raise ValueError(f"{name}: {heads} does not exist; pass a training run, a heads folder or a .gguf file")
    saved = _saved_kind(Path(heads))
    if saved is not None and saved != kind:
        raise ValueError(f"{name}: {heads} holds {saved} heads, not {kind}; write {METHOD}+{saved}:{heads}")
    return LlamaCppOptions(kind=kind, heads=heads, precision=precision, draft_max=draft_max)


def _saved_kind(path: Path) -> str | None:
    """The kind our heads folder (or a run's final/) records; None for anything else (a .gguf, a foreign layout):
    the runner's export, which knows every format, checks those."""
    for folder in (path, path / "final"):
        config = folder / "config.json"
        if config.is_file():
            kind = json.loads(config.read_text()).get("kind")
            return kind if isinstance(kind, str) else None
    return None


def plain_of(name: str) -> str | None:
    """The plain llama.cpp method at the same precision as the drafting one `name` (its own exactness reference:
    `llamacpp+KIND:DIR@q4_1+draft_max=1` -> `llamacpp@q4_1`; an engine method on llama.cpp's kernels,
    `ngram+backend=llamacpp+gguf=q4_1` -> `llamacpp@q4_1`); None for a name that drafts nothing on llama.cpp. Read
    from the name alone: the heads need not exist any more."""
    if _ON_LLAMACPP.search(name):
        gguf = _GGUF.search(name)
        return METHOD + (f"@{gguf[1]}" if gguf else "")
    if not is_llamacpp(name) or not name.startswith(f"{METHOD}+"):
        return None
    rest = _DRAFT_MAX.sub("", name)
    precision = _PRECISION.search(rest)
    return METHOD + (f"@{precision[1]}" if precision else "")

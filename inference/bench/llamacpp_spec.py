"""How `specheads bench --methods` names a llama.cpp method, parsed and checked without torch (the runner is
`specheads.inference.bench.llamacpp`):

    llamacpp                       the target's GGUF at the run's precision (f32 for --dtype float32, bf16 for bf16)
    llamacpp@q4_1                  another precision: f32, bf16, q8_0, or q4_1 (the default target's shipped file)
    llamacpp+eagle3:DIR            with EAGLE-3 heads (a run, a heads folder, or a .gguf written by export --to gguf)
    llamacpp+peagle:DIR@q4_1       P-EAGLE heads as llama.cpp's EAGLE-3 draft, against the Q4_1 target
    llamacpp+eagle3:DIR+draft_max=5   llama.cpp's --spec-draft-n-max; +p_min=0.6 its --spec-draft-p-min (without
                                   either: the settings measured fastest for these files on this machine, cached;
                                   `specheads.llamacpp.draft_settings`)
    llamacpp+peagle:DIR+measure=quick   measured with a smaller grid (`MEASUREMENTS`; default full)
    llamacpp+ngram-mod             llama.cpp's own training-free drafting (`TRAINING_FREE`: ngram-simple, ngram-mod,
                                   ngram-map-k, ngram-map-k4v, ngram-cache), at any precision, with +draft_max=N
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specheads.llamacpp.draft_settings import MEASUREMENTS

METHOD = "llamacpp"
PRECISIONS = ("f32", "bf16", "q8_0", "q4_1")
DEFAULT_DRAFT_MAX = 3  # llama.cpp's own default --spec-draft-n-max
# llama.cpp's own drafters that need no model (its --spec-type values): what a llama.cpp user tries first
TRAINING_FREE = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
_SETTING = re.compile(r"\+(draft_max|p_min|measure)=([a-z0-9.]+)$")
_PRECISION = re.compile(r"@([a-z0-9_]+)$")
# an engine method on llama.cpp's kernels (`+backend=llamacpp`, method_spec.py) and its target GGUF's precision
_ON_LLAMACPP = re.compile(r"\+backend=llamacpp(?=\+|$)")
_GGUF = re.compile(r"\+gguf=([a-z0-9_]+)(?=\+|$)")


@dataclass(frozen=True)
class LlamaCppOptions:
    kind: str | None = None  # the drafter's kind, or one of llama.cpp's own (`TRAINING_FREE`); None: plain decoding
    heads: str | None = None  # its run, heads folder or .gguf file (None for llama.cpp's own)
    precision: str | None = None  # the target GGUF's; None: the run's dtype (f32 or bf16)
    # --spec-draft-n-max and --spec-draft-p-min; both None with heads: measured (draft_settings.py); else the one
    # not given is llama.cpp's default (3 tokens; 0: no cut)
    draft_max: int | None = None
    p_min: float | None = None
    measure: str = "full"  # how much a measurement measures (`specheads.llamacpp.draft_settings.MEASUREMENTS`)

    @property
    def measured(self) -> bool:
        """Whether the drafting settings are measured for these heads (none given)."""
        return self.heads is not None and self.draft_max is None and self.p_min is None


def is_llamacpp(name: str) -> bool:
    return name == METHOD or name.startswith((f"{METHOD}+", f"{METHOD}@"))


def parse_llamacpp(name: str) -> LlamaCppOptions:
    """`llamacpp[+KIND:DIR][@PRECISION][+draft_max=N][+p_min=P][+measure=M]`, checked before anything loads."""
    rest = name[len(METHOD):]
    settings: dict[str, str] = {}
    while m := _SETTING.search(rest):
        settings.setdefault(m[1], m[2])
        rest = rest[: m.start()]
    draft_max = p_min = None
    if "draft_max" in settings:
        draft_max = int(settings["draft_max"]) if settings["draft_max"].isdigit() else 0
        if draft_max < 1:
            raise ValueError(f"{name}: +draft_max= is the most tokens llama.cpp drafts per step, an integer >= 1")
    if "p_min" in settings:
        try:
            p_min = float(settings["p_min"])
        except ValueError:
            p_min = -1.0
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"{name}: +p_min= is the drafter's probability below which llama.cpp stops a chain, "
                             "in [0, 1]")
    measure = settings.get("measure", "full")
    if measure not in MEASUREMENTS:
        raise ValueError(f"{name}: +measure= is how much llama.cpp's drafting settings are measured: one of "
                         f"{', '.join(MEASUREMENTS)}")
    if "measure" in settings and (draft_max is not None or p_min is not None):
        raise ValueError(f"{name}: +measure= measures the drafting settings, +draft_max=/+p_min= give them; "
                         "write one or the other")
    precision = None
    if m := _PRECISION.search(rest):
        precision, rest = m[1], rest[: m.start()]
        if precision not in PRECISIONS:
            raise ValueError(f"{name}: llama.cpp precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not rest:
        if settings:
            raise ValueError(f"{name}: +{next(iter(settings))}= needs a drafter: {METHOD}+KIND:DIR"
                             f"+{next(iter(settings))}={next(iter(settings.values()))}")
        return LlamaCppOptions(precision=precision)
    kind, _, heads = rest.removeprefix("+").partition(":")
    if rest.startswith("+") and kind in TRAINING_FREE and not heads:
        if p_min is not None:
            raise ValueError(f"{name}: +p_min= cuts a drafter model's chain; llama.cpp's {kind} has no probabilities")
        if "measure" in settings:
            raise ValueError(f"{name}: +measure= measures a drafter model's settings; give llama.cpp's {kind} "
                             "+draft_max=N")
        return LlamaCppOptions(kind=kind, precision=precision, draft_max=draft_max)
    if not rest.startswith("+") or not kind or not heads:
        raise ValueError(f"{name}: write {METHOD}, {METHOD}@PRECISION, "
                         f"{METHOD}+KIND:DIR[@PRECISION][+draft_max=N][+p_min=P] "
                         "(KIND: a drafter kind whose heads export --to gguf) or "
                         f"{METHOD}+MODE[@PRECISION][+draft_max=N] (MODE: one of llama.cpp's own "
                         f"{', '.join(TRAINING_FREE)})")
    if not Path(heads).exists():
        raise ValueError(f"{name}: {heads} does not exist; pass a training run, a heads folder or a .gguf file")
    saved = _saved_kind(Path(heads))
    if saved is not None and saved != kind:
        raise ValueError(f"{name}: {heads} holds {saved} heads, not {kind}; write {METHOD}+{saved}:{heads}")
    return LlamaCppOptions(kind=kind, heads=heads, precision=precision, draft_max=draft_max, p_min=p_min,
                           measure=measure)


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
    rest = name
    while m := _SETTING.search(rest):
        rest = rest[: m.start()]
    precision = _PRECISION.search(rest)
    return METHOD + (f"@{precision[1]}" if precision else "")

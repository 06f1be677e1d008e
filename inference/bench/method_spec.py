"""Method specs: how `specheads bench --methods` names each method to run, parsed and validated without torch.

A spec is an engine method of `specheads.inference.methods.METHODS` (`ar`, `ngram`, `draft:PATH`,
`draft:early-exit:N`, each drafter kind as `KIND:HEADS_DIR`; a method with named trees takes an optional `@TREE`
suffix to run the same heads with another tree, and `+OPTION=VALUE` suffixes set any of the method's options,
e.g. `+lookup=0` for the heads alone or `+draft_dtype=int8`; every engine method also takes `+compile=1` or `+compile=0`
to run with or without `--compile` whatever the run's flag, so the two compare in one interleaved run, and
`+structured=1` to decode each question under its `response_format`, a grammar: structured outputs; and
`+backend=llamacpp[+gguf=PRECISION]` to run the target forward on llama.cpp's kernels, on the target's GGUF at the
run's precision or the one named) or a
transformers baseline: `hf` (`generate`),
`hf-static` (`generate` with a static KV cache and its decode step compiled by `torch.compile`), `hf-assisted:PATH`
(assisted generation with a draft model) and `hf-pld[:N]` (prompt-lookup decoding, N draft tokens); or llama.cpp:
`llamacpp` and `llamacpp+KIND:DIR` (`specheads.inference.bench.llamacpp_spec`). Each engine method's options are built,
and so checked, while parsing: a bad spec fails before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from specheads.inference.bench.llamacpp_spec import METHOD as LLAMACPP
from specheads.inference.bench.llamacpp_spec import PRECISIONS, is_llamacpp, parse_llamacpp
from specheads.inference.methods import METHODS

BASELINES = ("hf", "hf-assisted", "hf-pld", "hf-static")
# "KIND:DIR+lookup=0+draft_dtype=int8": trailing option settings (the value may not contain "+" or "@")
_OPTION_SUFFIX = re.compile(r"\+([a-z][a-z0-9_-]*)=([^+@]*)$")
# suffixes every engine method takes: how the engine runs the target, not an option of the method
ENGINE_SETTINGS = ("compile", "structured", "backend", "gguf")
BACKENDS = ("torch", "llamacpp")  # what runs the target under an engine method (`+backend=`)
PLD_TOKENS = 10  # hf-pld draft length when none is given (the transformers docs' example value)


def valid_methods() -> list[str]:
    return [*METHODS.names(), *BASELINES, LLAMACPP]


@dataclass(frozen=True)
class MethodSpec:
    name: str  # as given, e.g. "draft:early-exit:8"; the key of every record and table row
    method: str  # "ar", "hf", "ngram", "draft", a drafter kind, ...
    arg: str | None = None  # draft model, heads folder, assistant model, or hf-pld draft length
    tree: str | None = None  # a named tree (or a tree file, where the method reads them) from an "@TREE" suffix
    lookup: int | None = None  # prompt-lookup continuations from a "+lookup=N" suffix (None: the method's default)
    settings: tuple[tuple[str, str], ...] = ()  # every "+OPTION=VALUE" suffix, as written
    compile: bool | None = None  # from a "+compile=0|1" suffix (None: the run's --compile)
    structured: bool = False  # "+structured=1": decode each question under its response_format (a grammar)
    backend: str = "torch"  # "+backend=llamacpp": the target forward on llama.cpp's kernels (llamacpp_backend.py)
    gguf: str | None = None  # "+gguf=PRECISION" with it: the target GGUF's (None: the run's dtype, as `llamacpp`)
    options: Any = None  # the engine method's options (None for the HF baselines)


def parse_methods(spec: str) -> list[MethodSpec]:
    """'ar,hf,ngram,draft:early-exit:8' -> specs; unknown names list the valid ones. Each engine method's options
    are built (and so validated) here, before any model loads."""
    out: list[MethodSpec] = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if any(s.name == name for s in out):
            raise ValueError(f"method {name!r} is listed twice in --methods")
        if is_llamacpp(name):
            opts = parse_llamacpp(name)
            out.append(MethodSpec(name=name, method=LLAMACPP, arg=opts.heads, options=opts))
            continue
        method, _, arg = name.partition(":")
        if "+" in method:  # `ngram+width=2`: option suffixes on a method that takes no argument
            method, plus, suffixes = method.partition("+")
            arg = plus + suffixes + (":" + arg if arg else "")
        if method not in METHODS and method not in BASELINES:
            raise ValueError(f"unknown method {method!r} in --methods; valid: {', '.join(valid_methods())}")
        out.append(_baseline_spec(name, method, arg) if method in BASELINES else _engine_spec(name, method, arg))
    if not out:
        raise ValueError("--methods is empty; e.g. --methods ar,hf,ngram")
    return out


def _baseline_spec(name: str, method: str, arg: str) -> MethodSpec:
    if method in ("hf", "hf-static") and arg:
        raise ValueError(f"method {method} takes no argument, got {name!r}; write {method}")
    if method == "hf-pld" and arg and not (arg.isdigit() and int(arg) >= 1):
        raise ValueError(f"{name}: the hf-pld argument is the draft length N >= 1, e.g. hf-pld:10")
    if method == "hf-assisted" and not arg:
        raise ValueError(f"method {method} needs a path: {method}:PATH")
    return MethodSpec(name=name, method=method, arg=arg or None)


def _engine_spec(name: str, method: str, arg: str) -> MethodSpec:
    """`METHOD[:ARG][@TREE][+OPTION=VALUE...]`: the suffixes are read only for methods with those options."""
    m = METHODS.get(method)
    if m.arg is not None and not arg:
        raise ValueError(f"method {method} needs a path: {method}:{m.arg_hint}")
    found: list[tuple[str, str]] = []  # read right to left
    while (suffix := _OPTION_SUFFIX.search(arg)) and (m.takes(key := suffix[1].replace("-", "_"))
                                                      or key in ENGINE_SETTINGS):
        if any(k == key for k, _ in found):
            raise ValueError(f"{name}: +{key}= is given twice")
        found.append((key, suffix[2]))
        arg = arg[: suffix.start()]
    settings = dict(reversed(found))
    compile = _flag(name, "compile", settings.pop("compile")) if "compile" in settings else None
    structured = _flag(name, "structured", settings.pop("structured")) if "structured" in settings else False
    backend, gguf = settings.pop("backend", "torch"), settings.pop("gguf", None)
    if backend not in BACKENDS:
        raise ValueError(f"{name}: +backend= takes {' or '.join(BACKENDS)}, got {backend!r}")
    if gguf is not None and (backend != "llamacpp" or gguf not in PRECISIONS):
        raise ValueError(f"{name}: +gguf= goes with +backend=llamacpp and takes {', '.join(PRECISIONS)}, got {gguf!r}")
    if backend == "llamacpp" and compile:
        raise ValueError(f"{name}: +compile=1 compiles our PyTorch forward; +backend=llamacpp runs llama.cpp's")
    if m.arg is None and arg:
        if unknown := _OPTION_SUFFIX.search(arg):  # no path to hide in: any suffix left names an unknown option
            takes = ", ".join(f.name for f in fields(m.options)) or "none"
            raise ValueError(f"{name}: {method} has no option {unknown[1]!r} (its options: {takes})")
        raise ValueError(f"method {method} takes no argument, got {name!r}")
    tree = None
    if m.takes("tree") and "@" in arg and "/" not in arg.rpartition("@")[2]:  # "@" inside a folder name is no tree
        arg, _, tree = arg.rpartition("@")
        if not arg or not tree:
            example = list(m.trees)[-1] if m.trees else "TREE"
            raise ValueError(f"{name}: write {method}:DIR@TREE, e.g. {method}:runs/x/final@{example}")
    if m.arg is not None and not arg:
        raise ValueError(f"{name}: {method} needs a path before its suffixes: "
                         f"{method}:{m.arg_hint}[@TREE][+OPTION=VALUE]")
    try:
        values = {key: m.parse_option(key, text) for key, text in settings.items()}
        options = m.make_options({**values, "tree": tree, **({m.arg: arg} if m.arg else {})})
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    return MethodSpec(name=name, method=method, arg=arg or None, tree=tree, lookup=values.get("lookup"),
                      settings=tuple(settings.items()), compile=compile, structured=structured, backend=backend,
                      gguf=gguf, options=options)


def _flag(name: str, key: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name}: +{key}= takes 1 (on) or 0 (off), got {text!r}")
    return text == "1"

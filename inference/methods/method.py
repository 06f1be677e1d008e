"""A decoding method's declaration (`Method`), the `METHODS` registry and what is derived from it: options from
flags, option flags for the command line, proposers. Method modules import this module, never the package, so none
of them imports a half-built package."""


from __future__ import annotations

import importlib
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from specheads.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specheads.inference.engine.proposer import Proposer

# Loads a draft model and checks it shares the target's vocabulary; injected so no method needs target I/O.
DraftLoader = Callable[[str], "PreTrainedModel"]
# (target, options, load_draft) -> proposer
Build = Callable[["PreTrainedModel", Any, "DraftLoader | None"], "Proposer"]


@dataclass(frozen=True)
class Method:
    name: str  # `--method NAME`; a drafter kind's method carries the kind's name
    summary: str  # one line for help texts
    options: type  # frozen dataclass of the method's options (fields made with `option`), validated on construction
    # "module:function" of the `Build` that makes the proposer, imported on first use (so declaring a method
    # imports no torch), or the function itself
    build: str | Build
    arg: str | None = None  # the option a bench spec `NAME:ARG` fills; required when set
    arg_hint: str = "PATH"  # how to write that argument, for messages and help
    trees: Mapping[str, Any] = field(default_factory=dict)  # named trees of the `tree` option (bench's NAME:ARG@TREE)

    def __post_init__(self) -> None:
        if not is_dataclass(self.options):
            raise TypeError(f"method {self.name!r}: options must be a dataclass, got {self.options!r}")
        if self.arg is not None and not self.takes(self.arg):
            raise TypeError(f"method {self.name!r}: arg {self.arg!r} is not one of its options")
        if isinstance(self.build, str) and not re.fullmatch(r"[\w.]+:\w+", self.build):
            raise TypeError(f"method {self.name!r}: build must be 'package.module:function', got {self.build!r}")

    def builder(self) -> Build:
        """The function that builds this method's proposer (its module imported now, if named by a string)."""
        if not isinstance(self.build, str):
            return self.build
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)

    def takes(self, name: str) -> bool:
        return any(f.name == name for f in fields(self.options))

    def make_options(self, values: Mapping[str, Any]) -> Any:
        """The options from {option: value}; None means "not given" (the default). A value for an option this
        method does not take is refused, naming the flags it does take; a missing `arg` is refused."""
        given = {k: v for k, v in values.items() if v is not None}
        foreign = [k for k in given if not self.takes(k)]
        if foreign:
            takes = ", ".join(flag(f.name) for f in fields(self.options)) or "no options"
            raise ValueError(f"{flag(foreign[0])} does not apply to --method {self.name} (it takes {takes})")
        if self.arg is not None and self.arg not in given:
            raise ValueError(f"method {self.name!r} needs {flag(self.arg)} {self.arg_hint}")
        return self.options(**given)

    def parse_option(self, name: str, text: str) -> Any:
        """The value of option `name` written as `text` (bench's `+NAME=VALUE`), converted to the option's type."""
        kind = _scalar(typing.get_type_hints(self.options)[name], f"{self.name}.{name}")
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{flag(name)} takes {'an integer' if kind is int else 'a number'}, "
                             f"got {text!r}") from None

    def heads_alone(self, path: str, chain: bool = False, tree: str | None = None) -> Any:
        """Options for the drafter saved at `path` with nothing grafted on and its whole trees verified (what
        training measures: the heads' own τ, the same on every machine); with `chain`, drafting one token per level
        where the method builds trees; `tree` names the tree instead (e.g. "chain3", a chain engine's draft)."""
        if tree is not None and not self.takes("tree"):
            raise ValueError(f"method {self.name!r} drafts no named trees; measure it without tree={tree!r}")
        return self.make_options({self.arg: path, **({"lookup": 0} if self.takes("lookup") else {}),
                                  **({"node_budget": "fixed"} if self.takes("node_budget") else {}),
                                  **({"topk": 1} if chain and self.takes("topk") else {}),
                                  **({"tree": tree} if tree is not None else {})})


METHODS: Registry[Method] = Registry("method", builtins="specheads.inference.methods.builtin")


def register_method(method: Method) -> Method:
    return METHODS.register(method.name, method)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class OptionFlag:
    name: str  # the options field, e.g. "total_tokens" (flag --total-tokens)
    type: type  # int, float or str
    help: str  # "method: help" for every method that takes it


def option_flags() -> list[OptionFlag]:
    """Every option of every registered method, once, with its type and the methods that take it, in order."""
    seen: dict[str, tuple[type, dict[str, list[str]]]] = {}
    for name, method in METHODS.items():
        hints = typing.get_type_hints(method.options)
        for f in fields(method.options):
            if f.default is MISSING and f.default_factory is MISSING:
                raise TypeError(f"method {name!r}: option {f.name!r} needs a default (None = not given)")
            kind = _scalar(hints[f.name], f"{name}.{f.name}")
            known_kind, helps = seen.setdefault(f.name, (kind, {}))
            if known_kind is not kind:
                raise TypeError(f"option {f.name!r} is {known_kind.__name__} in one method, "
                                f"{kind.__name__} in {name!r}")
            helps.setdefault(f.metadata.get("help", ""), []).append(name)
    return [OptionFlag(n, kind, "; ".join(f"{', '.join(ms)}: {h}" for h, ms in helps.items()))
            for n, (kind, helps) in seen.items()]


def _scalar(tp: Any, where: str) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if len(args) != 1 or args[0] not in (int, float, str):
        raise TypeError(f"option {where} must be int, float or str (optionally | None), got {tp}")
    return args[0]


def make_proposer(method: str, target: PreTrainedModel, options: Any, load_draft: DraftLoader | None) -> Proposer:
    """The proposer `method` builds for `target` with `options` (its own options class, e.g. from make_options)."""
    spec = METHODS.get(method)
    if not isinstance(options, spec.options):
        raise TypeError(f"method {method!r} takes {spec.options.__name__}, got {type(options).__name__}")
    return spec.builder()(target, options, load_draft)


def method_label(method: str, options: Any) -> str:
    """`method` and the options given to it, as one string (e.g. "eagle+heads=runs/x/final+depth=3"): what a
    calibration was measured with."""
    given = [f"{f.name}={getattr(options, f.name)}" for f in fields(options) if getattr(options, f.name) is not None]
    return "+".join([method, *given])

"""Drafter kinds: each trained drafter is declared once here, and everything else asks this table.

A kind is a name, a typed config (a frozen dataclass saved as the checkpoint's `config`), a module
built from that config and the frozen target, and the prefixes of the module's state dict that are
the target's own weights (shared, never saved). The checkpoint format (`specheads.heads.checkpoint`)
is the same for every kind; training registers an objective for a kind in `specheads.train`, and
decoding a proposer factory in `specheads.inference`, both under the kind's name.

The built-in kinds register themselves when `specheads.heads` is imported (first use of `KINDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

from torch import nn

from specheads.registry import Registry


@dataclass(frozen=True)
class DrafterKind:
    name: str  # the checkpoint's kind, the decoding method's name, the default recipe name
    config: type  # frozen dataclass; its fields are the checkpoint's `config` (read strictly)
    build: Callable[[Any, nn.Module], nn.Module]  # (config, target model) -> module with a `.config` attribute
    module: type[nn.Module]  # what `build` returns: how a built module finds its kind (`kind_of`)
    shared_prefixes: tuple[str, ...] = ()  # state-dict keys of frozen target weights the module holds: never saved
    summary: str = ""  # one line for help texts

    def __post_init__(self) -> None:
        if not is_dataclass(self.config):
            raise TypeError(f"drafter kind {self.name!r}: config must be a dataclass, got {self.config!r}")


KINDS: Registry[DrafterKind] = Registry("drafter kind", builtins="specheads.heads")


def register_kind(kind: DrafterKind) -> DrafterKind:
    return KINDS.register(kind.name, kind)


def kind_of(module: nn.Module) -> DrafterKind:
    """The kind whose module class built `module` (DDP-unwrapped modules only)."""
    for _, kind in KINDS.items():
        if type(module) is kind.module:
            return kind
    raise ValueError(f"{type(module).__name__} is not the module of a registered drafter kind "
                     f"({', '.join(KINDS.names())}); register its kind with specheads.kinds.register_kind")

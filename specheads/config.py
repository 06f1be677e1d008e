"""YAML -> frozen dataclasses, with `key=value` overrides and validation that names the fix.

Nested dataclass fields become YAML sections; overrides use dotted keys
(`data.max_conversations=200`). Values in overrides are parsed as YAML scalars,
so `max_steps=100`, `resume=true` and `optim.lr=3e-4` get their natural types.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(key: str, known: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ValueError(f"unknown config key {where}{key!r}{hint}")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], name) if len(args) == 1 else value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key {name!r} must be a section (mapping), got {value!r}")
        return build(tp, value, prefix=f"{name}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key {name!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key {name!r} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key {name!r} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"config key {name!r} must be a string, got {value!r}")
        return str(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key {name!r} must be a list, got {value!r}")
        item = typing.get_args(tp)[0] if typing.get_args(tp) else None
        items = [_coerce(v, item, f"{name}[{i}]") if item not in (None, typing.Any) else v for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return value


def build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with the nearest known one."""
    types_ = _field_types(cls)
    renamed = getattr(cls, "RENAMED", {})  # a ClassVar {old key: new key} on classes whose keys were renamed
    for key in data:
        if key in renamed and key not in types_:
            raise ValueError(f"config key {prefix}{key} is now {prefix}{renamed[key]}; "
                             "rename it in the config or override")
        if key not in types_:
            raise _unknown_key(key, list(types_), prefix)
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` strings to a nested dict (copying as it goes)."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value; e.g. max_steps=100 or data.max_conversations=200")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return out


def _deepcopy(d: Any) -> Any:
    return {k: _deepcopy(v) for k, v in d.items()} if isinstance(d, dict) else d


def read_config_data(path: str | Path | None, overrides: list[str] = ()) -> dict[str, Any]:
    """The YAML mapping at `path` (or an empty one) with `key=value` overrides applied, not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist; pass one of the YAML recipes in configs/")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
    return apply_overrides(data, list(overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML/JSON data (tuples become lists), so a saved config compares equal to a loaded one."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

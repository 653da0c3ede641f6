"""Typed hyper-parameters: the one place where a method's parameter dataclass is turned into JSON and back.

Every parameter dataclass (GromParams, the gradient methods', TrainerParams) derives from `Params`:

    params = NPOParams.from_dict({"beta": 0.2, "trainer": {"epochs": 3}})
    params.to_dict()        # JSON-able: tuples become lists, nested Params become dicts

`from_dict` is where user input (CLI `--params`, a registered service's stored parameters) is checked: an unknown
key, a value of the wrong type, a non-finite number (NaN, Infinity) or a value out of range is a `ParamsError` that
names the field and what it accepts, raised before any work is done.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Self

from grom_core.errors import ParamsError

__all__ = ["Params", "ParamsError", "merged"]


def _type_name(tp: Any) -> str:
    """How a user reads the type (JSON words: a list, null)."""
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(owner: str, name: str, tp: Any, value: Any) -> Any:
    """`value` as type `tp` (int is accepted for float, a list for a tuple), or a ParamsError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(owner, name, option, value)
            except ParamsError:
                continue
        raise ParamsError(f"{owner}.{name} must be {' or '.join(_type_name(o) for o in options)}, got {value!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ParamsError(f"{owner}.{name} must be {_type_name(tp)}, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_convert(owner, name, inner, v) for v in value)
    if isinstance(tp, type) and issubclass(tp, Params):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ParamsError(f"{owner}.{name} must be an object of {tp.__name__} fields, got {value!r}")
        return tp.from_dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # JSON's NaN, Infinity and 1e400 pass every range check
                raise ParamsError(f"{owner}.{name} must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ParamsError(f"{owner}.{name} must be {_type_name(tp)}, got {value!r}")


class Params:
    """Mixin of the frozen parameter dataclasses: `to_dict`, `from_dict` (checked) and `validate`."""

    def validate(self) -> None:
        """Range checks; raise ParamsError naming the field. Subclasses extend it."""

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Params):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None) -> Self:
        """Build and validate from a JSON-like mapping; unknown keys and wrong types are refused by name."""
        values = dict(values or {})
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ParamsError(f"{cls.__name__} has no parameter {', '.join(map(repr, unknown))}; "
                              f"it takes {', '.join(sorted(fields))}")
        params = cls(**{k: _convert(cls.__name__, k, hints[k], v) for k, v in values.items()})
        params.validate()
        return params

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (checked like `from_dict`); a mapping given for a nested Params changes only the
        fields it names."""
        return type(self).from_dict(merged(self.to_dict(), changes))


def merged(values: Mapping[str, Any], changes: Mapping[str, Any]) -> dict:
    """`values` with `changes` applied, nested mappings merged key by key rather than replaced."""
    out = dict(values)
    for key, change in changes.items():
        if isinstance(change, Params):
            change = change.to_dict()
        if isinstance(change, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], change)
        else:
            out[key] = change
    return out

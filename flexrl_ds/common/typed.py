"""Strict construction of typed config dataclasses from JSON-like dicts.

`from_dict(SPConfig, {...}, where="flexrl.sp")` checks every key against the dataclass fields and
every value against the field's annotated type, recursing into nested dataclasses. Errors are
`ValueError`s that name the full dotted key, e.g. `flexrl.sp.p_max: expected int, got "8"`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrongly typed values."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field is missing
        raise ValueError(f"{where}: {error}") from None


def _convert(annotation: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where}: no accepted type matches {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        (item_type, *_) = typing.get_args(annotation) or (Any,)
        items = [_convert(item_type, item, f"{where}[{i}]") for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)  # type: ignore[arg-type]
    if annotation is Any:
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation in (str, bool):
        if not isinstance(value, annotation):
            raise ValueError(f"{where}: expected {annotation.__name__}, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported annotation {annotation!r}")  # programming error


def to_dict(config: Any) -> dict:
    """The JSON-ready dict of a config dataclass (inverse of `from_dict`)."""
    return dataclasses.asdict(config)

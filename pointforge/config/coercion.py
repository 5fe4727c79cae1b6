"""A dataclass from a (nested) mapping and back to plain data, with every value checked.

:func:`from_dict` coerces values to the declared field types (YAML scalars and
override strings alike); an unknown key or a value of the wrong type raises
:class:`~pointforge.errors.ConfigError` naming the dotted key, the valid
choices (with a close-match suggestion) and the expected type. :func:`to_dict`
turns a config back into plain YAML/JSON-able data, which is what run
directories and checkpoints store.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

import yaml

from pointforge.errors import ConfigError

T = TypeVar("T")

_NONE_WORDS = {"none", "null", "~", ""}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


# --------------------------------------------------------------------------- generic loading


def _suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _suggest_key(prefix: str, name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{_join(prefix, close[0])}'? " if close else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        names = [_type_name(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in args else text
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values ({', '.join(_type_name(a) for a in args)})"
        inner = _type_name(args[0]) if args else "any"
        return f"a list of {inner}"
    if origin is dict:
        return "a mapping"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a section ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _fail(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"config key '{key}' got {value!r}, expected {_type_name(tp)}")


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if type(None) in args and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS)):
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, key)
        except ConfigError:
            if dataclasses.is_dataclass(arg) and isinstance(value, Mapping):
                raise  # an optional section given as a mapping: its own error says what is wrong inside
            continue
    raise _fail(key, value, tp)


def _coerce_literal(value: Any, tp: Any, key: str) -> Any:
    choices = typing.get_args(tp)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices):
        # YAML 1.1 reads on/off/yes/no as booleans; map them back to words.
        for word in (("on", "off"), ("true", "false"), ("yes", "no")):
            if word[0] in choices and word[1] in choices:
                return word[0] if value else word[1]
    for choice in choices:
        if value == choice or (isinstance(value, str) and isinstance(choice, str) and value.strip() == choice):
            return choice
    shown = ", ".join(str(c) for c in choices)
    hint = _suggest(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
    raise ConfigError(f"config key '{key}' got {value!r}; {hint}valid choices: {shown}")


def _coerce_enum(value: Any, tp: type[enum.Enum], key: str) -> Any:
    names = [m.value for m in tp]
    for member in tp:
        if value == member.value or value == member.name or value is member:
            return member
    raise ConfigError(
        f"config key '{key}' got {value!r}; {_suggest(str(value), names)}valid choices: {', '.join(map(str, names))}"
    )


def _coerce_section(value: Any, tp: Any, key: str) -> Any:
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key '{key}' is a section; give it as a mapping of keys, e.g. {key}.<name>=<value>")
    return from_dict(tp, value, prefix=key)


def _coerce_bool(value: Any, tp: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise _fail(key, value, tp)


def _coerce_int(value: Any, tp: Any, key: str) -> int:
    if isinstance(value, bool):
        raise _fail(key, value, tp)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                as_float = float(value)
            except ValueError:
                raise _fail(key, value, tp) from None
            if as_float.is_integer():
                return int(as_float)
    raise _fail(key, value, tp)


def _coerce_float(value: Any, tp: Any, key: str) -> float:
    if isinstance(value, bool):
        raise _fail(key, value, tp)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _fail(key, value, tp) from None
        if math.isnan(number):
            raise _fail(key, value, tp)
        return number
    raise _fail(key, value, tp)


def _coerce_str(value: Any, tp: Any, key: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise _fail(key, value, tp)


def _coerce_sequence(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    items = value
    if isinstance(items, str):
        text = items.strip()
        if text.startswith("["):
            items = yaml.safe_load(text)
        else:
            items = [part.strip() for part in text.split(",")] if text else []
    if not isinstance(items, (list, tuple)):
        raise _fail(key, value, tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise _fail(key, value, tp)
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(items, args)))
    inner = args[0] if args else Any
    converted = [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(items)]
    return tuple(converted) if (origin is tuple or tp is tuple) else converted


def _coerce_mapping(value: Any, tp: Any, key: str) -> dict:
    if not isinstance(value, Mapping):
        raise _fail(key, value, tp)
    args = typing.get_args(tp)
    if not args:
        return dict(value)
    return {coerce(k, args[0], key): coerce(v, args[1], _join(key, str(k))) for k, v in value.items()}


_SCALARS: dict[Any, Any] = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or an override string) to type ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        return _coerce_literal(value, tp, key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _coerce_enum(value, tp, key)
    if dataclasses.is_dataclass(tp):
        return _coerce_section(value, tp, key)
    if tp in _SCALARS:
        return _SCALARS[tp](value, tp, key)
    if origin in (tuple, list) or tp in (tuple, list):
        return _coerce_sequence(value, tp, key)
    if origin is dict or tp is dict:
        return _coerce_mapping(value, tp, key)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _fail(key, value, tp)


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def from_dict(
    cls: type[T], data: Mapping[str, Any] | None, *, prefix: str = "", types: Mapping[str, type] | None = None
) -> T:
    """Build dataclass ``cls`` from a (nested) mapping, checking keys and coercing types.

    ``types`` replaces the declared type of top-level fields, which is how a
    training config's ``task`` section gets the task's own dataclass.
    """
    data = dict(data or {})
    fields = _fields(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in fields:
            valid = sorted(fields)
            raise ConfigError(
                f"unknown config key '{_join(prefix, str(name))}'; {_suggest_key(prefix, str(name), valid)}"
                f"valid keys{' in ' + prefix if prefix else ''}: {', '.join(valid)}"
            )
        tp = (types or {}).get(name, fields[name][1])
        kwargs[name] = coerce(value, tp, _join(prefix, name))
    for name, (fld, _tp) in fields.items():
        tp = (types or {}).get(name)
        if name not in kwargs and tp is not None and dataclasses.is_dataclass(tp):
            kwargs[name] = tp()
        if name not in kwargs and fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"config key '{_join(prefix, name)}' is required; add it to the config file or pass {_join(prefix, name)}=<value>"
            )
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config section '{prefix or cls.__name__}' is invalid: {err}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(prefix)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, str, numbers, bool, None) for YAML, JSON and checkpoints."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj

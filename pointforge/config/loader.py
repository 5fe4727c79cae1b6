"""Loading configs: YAML files, dotted ``key=value`` overrides, deep merge, and writing them back.

Any dataclass can be loaded with :func:`load` (a YAML file, then overrides such
as ``optim.lr=1e-4``); :func:`pointforge.config.coercion.from_dict` checks and
coerces the merged data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

from pointforge.atomic import atomic_write_text
from pointforge.config.coercion import from_dict, to_dict
from pointforge.errors import ConfigError

T = TypeVar("T")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["optim.lr=1e-4", "data.global_batch=16"]`` → nested dict of raw values.

    Values are read as YAML scalars/lists (so ``[0.9,0.99]`` and ``null`` work);
    :func:`from_dict` then coerces them to the field types.
    """
    nested: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value; write it like optim.lr=1e-4")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' has an empty key; write it like optim.lr=1e-4")
        text = raw.strip()
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        # YAML would read "a: b" as a mapping and "#x" as a comment; an
        # override value is one scalar or list, so keep such text verbatim.
        if isinstance(value, dict) or (value is None and text.startswith("#")):
            value = text
        elif isinstance(value, str) and not text.startswith(("'", '"')):
            value = text
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
            node = child
        node[parts[-1]] = value
    return nested


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; check the path given to --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(data).__name__}")
    return data


def load(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    types: Mapping[str, type] | None = None,
) -> T:
    """Load dataclass ``cls`` from an optional YAML file plus ``key=value`` overrides."""
    data = load_yaml(path) if path is not None else {}
    data = deep_merge(data, parse_overrides(overrides))
    return from_dict(cls, data, types=types)


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)


def save_yaml(obj: Any, path: str | os.PathLike) -> None:
    atomic_write_text(path, dump_yaml(obj))

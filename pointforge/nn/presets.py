"""The one rule for named network sizes: ``preset(kind, PRESETS, name, **overrides)``.

Every network (PVCNN2, voxelizer, upsampler) keeps a ``PRESETS`` table of
named configs (``tiny`` for CI, ``small`` for CPU, ``paper`` for GPUs); a
preset is looked up, optionally with fields overridden, and a wrong name or
field is one ConfigError naming the choices, the same way for each.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping, TypeVar, Union

from pointforge.errors import ConfigError

__all__ = ["preset"]

C = TypeVar("C")


def preset(kind: str, table: Mapping[str, Union[C, Callable[[], C]]], name: str, **overrides: Any) -> C:
    """``table[name]`` (an instance, or a function building one) with ``overrides`` replaced.

    ``kind`` names the network in messages (``"voxelizer"``); unknown names and
    fields get a did-you-mean and the valid choices.
    """
    if name not in table:
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown {kind} preset {name!r}; {hint}choose one of {', '.join(table)}")
    entry = table[name]
    # Any: the table holds C or a builder of C, which mypy cannot tell apart by is_dataclass.
    config: Any = entry() if callable(entry) and not dataclasses.is_dataclass(entry) else entry
    if not overrides:
        return config
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown {kind} config field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return dataclasses.replace(config, **overrides)

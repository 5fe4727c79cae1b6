"""The optional compiled paths, in one table: which exist, which are available, which one runs.

Some operators have a compiled CPU variant beside their plain PyTorch path (Numba kernels;
ducc0's FFTs for DPSR). Both give the same result (the compiled path's tests hold it to the
plain one); the compiled one is faster where it applies. Every such operator takes the same
keyword, ``backend``:

* ``"auto"`` (the default everywhere): the compiled path where it applies to the inputs (CPU
  tensors of the dtypes it reads), the operator's input reaches the row's ``min_size`` and its
  packages import; the plain path otherwise.
* ``"plain"``: the plain path, always.
* ``"compiled"``: the compiled path, or a one-line error saying why it cannot run.

``POINTFORGE_BACKEND=plain`` in the environment turns every ``"auto"`` into ``"plain"`` (to
rule the compiled paths out while debugging); an explicit ``"compiled"`` is still honoured.
The variable is read at each choice.

A compiled module, and with it Numba or ducc0, is imported only when ``"auto"`` or
``"compiled"`` is about to run it: importing pointforge, or running on small inputs or CUDA,
never loads them. :func:`available` answers from the installed packages without importing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from pointforge.errors import ConfigError, DataError

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "PATHS",
    "CompiledPath",
    "available",
    "check_backend",
    "choose",
    "forced_plain",
    "load",
]

BACKENDS = ("auto", "plain", "compiled")
ENV_VAR = "POINTFORGE_BACKEND"


@dataclass(frozen=True)
class CompiledPath:
    """One compiled variant: the operator it serves, its module, the packages it needs and
    the size from which ``"auto"`` takes it."""

    op: str  # the operator's name in messages
    module: str  # imported on first use only
    packages: tuple[str, ...]
    min_size: int  # ``"auto"`` takes the compiled path from this size up ...
    unit: str  # ... counted in these


# The thresholds: below them the plain path is quick enough that the compiled one gains
# little, and a process that only meets small inputs (the tiny and demo presets) never pays
# Numba's import and first compilation. Measured by bench/fps_compiled.py,
# bench/three_nn_compiled.py and bench/fused_norm.py (docs/experiments/benchmarks.md).
PATHS: dict[str, CompiledPath] = {
    "fps": CompiledPath("furthest_point_sample", "pointforge.nn.pvops.fps_compiled", ("numba",), 8192, "points"),
    "three_nn": CompiledPath(
        "three_nearest_neighbors", "pointforge.nn.pvops.three_nn_compiled", ("numba",), 2048, "points"
    ),
    "fused_norm": CompiledPath("fused GroupNorm", "pointforge.nn.fused_norm_compiled", ("numba",), 1 << 16, "elements"),
    # ducc0's FFTs and the pruned forward solve (Numba) are one path: the pruned solve is
    # written against ducc0's in-place transforms, and the backward pass uses the same FFTs.
    "dpsr": CompiledPath("DPSR", "pointforge.nn.dpsr_pruned", ("ducc0", "numba"), 0, "grid nodes"),
}


def check_backend(op: str, backend: str) -> str:
    """``backend`` itself once it is one of :data:`BACKENDS`; a :class:`ConfigError` otherwise."""
    if backend not in BACKENDS:
        raise ConfigError(f"{op}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def forced_plain() -> bool:
    """Whether :data:`ENV_VAR` turns ``"auto"`` into ``"plain"`` (values: ``auto`` or unset, ``plain``)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return False
    if value == "plain":
        return True
    raise ConfigError(f"{ENV_VAR}={value!r} is not understood; set it to 'plain' (or 'auto', or unset it)")


def available(name: str) -> bool:
    """Whether every package the compiled path ``name`` needs is installed (nothing is imported)."""
    return all(importlib.util.find_spec(package) is not None for package in PATHS[name].packages)


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled path's module, imported on first use; None when its packages do not import."""
    if not available(name):
        return None
    try:
        return importlib.import_module(PATHS[name].module)
    except ImportError:
        return None


def choose(name: str, backend: str, size: int, unsuited: Callable[[], str | None]) -> ModuleType | None:
    """The compiled module to run for one call of the operator, or None for its plain path.

    ``size`` is compared with the row's ``min_size`` (``"auto"`` only); ``unsuited()`` is
    None when the compiled path handles these inputs, else what it needs (for the error of an
    explicit ``"compiled"``); it is called only when the answer matters.
    """
    path = PATHS[name]
    check_backend(path.op, backend)
    if backend == "plain" or (backend == "auto" and (forced_plain() or size < path.min_size)):
        return None
    need = unsuited()
    if backend == "auto":
        return None if need is not None else load(name)
    if need is not None:
        raise DataError(f"{path.op}: backend='compiled' needs {need}; use backend='auto'")
    module = load(name)
    if module is None:
        packages = " ".join(path.packages)
        raise ConfigError(
            f"{path.op}: backend='compiled' needs {', '.join(path.packages)}; pip install {packages}, "
            "or use backend='auto'"
        )
    return module

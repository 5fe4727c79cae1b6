"""Writing a synthetic dataset: skulls of one family, with defects, in a SkullBreak or SkullFix layout.

Seeds: skull ``k`` of ``synthesize(seed=s)`` is the same for any number of
skulls, and each defect class has its own random stream, so outputs are
reproducible piece by piece.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from pointforge.data.skulls.layouts import LAYOUTS
from pointforge.data.synthetic import anatomical, domes
from pointforge.data.synthetic.defects import DEFECT_CLASSES, SKULLFIX_DEFECT, make_defect
from pointforge.data.synthetic.grid import check_size, grid_origin, skullfix_shape
from pointforge.data.volumes import as_triple, write_volume
from pointforge.errors import ConfigError, DataError


class SkullFamily(Protocol):
    """How a family makes one complete skull: ``(bool volume, spacing in mm)``, drawing from ``rng`` only."""

    def __call__(
        self,
        size: int,
        rng: np.random.Generator,
        *,
        shape: tuple[int, int, int] | None = None,
        spacing: tuple[float, float, float] | None = None,
    ) -> tuple[np.ndarray, tuple[float, float, float]]: ...


FAMILIES: dict[str, SkullFamily] = {"domes": domes.make_skull, "anatomical": anatomical.make_skull}


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    return layout


def _check_family(family: str) -> SkullFamily:
    if family not in FAMILIES:
        raise ConfigError(f"unknown skull family {family!r}; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def _check_count_and_seed(n_skulls: int, seed: int) -> None:
    if isinstance(n_skulls, bool) or not isinstance(n_skulls, (int, np.integer)) or not 1 <= n_skulls <= 1000:
        raise ConfigError(f"number of skulls must be from 1 to 1000 (three-digit case ids), got {n_skulls!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")


def synthesize(
    out_dir: str | os.PathLike,
    n_skulls: int,
    size: int,
    seed: int,
    layout: str = "skullbreak",
    progress: Callable[[int, int, str], None] | None = None,
    *,
    family: str = "domes",
) -> dict[str, Any]:
    """Write ``n_skulls`` synthetic cases of skull ``family`` in a SkullBreak or SkullFix folder layout.

    SkullBreak: ``complete_skull/NNN.nrrd``, ``defective_skull/<class>/NNN.nrrd``
    and ``implant/<class>/NNN.nrrd`` for each class in :data:`DEFECT_CLASSES`,
    S³ voxels. SkullFix: ``complete_skull/``, ``defective_skull/`` and
    ``implant/`` with one vault defect per skull, S×S×Z voxels. ``family`` names
    one of :data:`FAMILIES`. ``progress`` is called as ``progress(done, total,
    case_id)`` after each skull. Returns a summary: the cases with their shapes,
    spacings and voxel counts, and seconds.
    """
    layout = _check_layout(layout)
    size = check_size(size)
    _check_count_and_seed(n_skulls, seed)
    make_skull = _check_family(family)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a folder; choose another output path")
    started = time.perf_counter()
    classes = DEFECT_CLASSES if layout == "skullbreak" else (SKULLFIX_DEFECT,)
    cases = []
    for k, case_seed in enumerate(np.random.SeedSequence(int(seed)).spawn(int(n_skulls))):
        case_id = f"{k:03d}"
        skull_seed, *defect_seeds = case_seed.spawn(1 + len(DEFECT_CLASSES))
        skull_rng = np.random.default_rng(skull_seed)
        shape = None if layout == "skullbreak" else skullfix_shape(size, skull_rng)
        complete, spacing = make_skull(size, skull_rng, shape=shape)
        cases.append(_write_case(out, case_id, complete, spacing, layout, classes, defect_seeds))
        if progress is not None:
            progress(k + 1, int(n_skulls), case_id)
    return {
        "out_dir": str(out),
        "layout": layout,
        "n_skulls": int(n_skulls),
        "size": size,
        "seed": int(seed),
        "defect_classes": list(classes),
        "cases": cases,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _write_case(
    out: Path,
    case_id: str,
    complete: np.ndarray,
    spacing: tuple[float, float, float],
    layout: str,
    classes: tuple[str, ...],
    defect_seeds: list[np.random.SeedSequence],
) -> dict[str, Any]:
    """Write one skull and its defects; the case's entry in the summary."""
    origin = as_triple(grid_origin(complete.shape, np.asarray(spacing)))
    write_volume(out / "complete_skull" / f"{case_id}.nrrd", complete, spacing=spacing, origin=origin)
    defects = {}
    for defect_class, defect_seed in zip(classes, defect_seeds):
        implant = make_defect(complete, defect_class, np.random.default_rng(defect_seed), spacing)
        defective = complete & ~implant
        sub = () if layout == "skullfix" else (defect_class,)
        write_volume(
            out.joinpath("defective_skull", *sub, f"{case_id}.nrrd"), defective, spacing=spacing, origin=origin
        )
        write_volume(out.joinpath("implant", *sub, f"{case_id}.nrrd"), implant, spacing=spacing, origin=origin)
        defects[defect_class] = {"implant_voxels": int(implant.sum()), "defective_voxels": int(defective.sum())}
    return {
        "id": case_id,
        "shape": [int(s) for s in complete.shape],
        "spacing": list(spacing),
        "origin": list(origin),
        "complete_voxels": int(complete.sum()),
        "defects": defects,
    }

"""Synthetic training data made on first use, once, however many processes ask at the same time.

A training config can name a ``data_root`` that does not exist yet together
with a recipe for synthetic skulls; :func:`ensure_synthetic_prepared` then
synthesises the raw volumes and prepares them into that folder, so a fresh
clone trains with nothing prepared beforehand.

Several processes (the ranks of a job, or two jobs) may call it for the same
folder at once. They serialise on an advisory lock (``fcntl.flock``) on a lock
file beside the folder; the first builds everything in a temporary sibling
folder and renames it into place, the others wait for the lock, find the
folder and return. No collective is involved, so ranks may arrive at any time.
A crash mid-build leaves only a temporary folder, which the next builder
removes: a folder under the final name is always complete.

The prepared folder (what :class:`~pointforge.data.skulls.prepared.PreparedDataset`
reads) also holds the raw volumes under ``raw/`` (useful as reference volumes
for inference) and ``synthetic.json``, the recipe it was made with. The recipe
as a config writes it, ``task.synthetic`` of the PCDiff and voxelizer tasks, is
:class:`SyntheticSection`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pointforge.atomic import atomic_write_text
from pointforge.data import prepare  # called as prepare.X / synthetic.X, so a test can replace them
from pointforge.data.skulls.splits import check_split
from pointforge.data.synthetic import dataset as synthetic
from pointforge.data.synthetic.grid import MAX_SIZE, MIN_SIZE
from pointforge.errors import ConfigError, DataError
from pointforge.flock import exclusive_lock

__all__ = ["RECIPE_FILE", "RAW_DIR", "SyntheticSection", "ensure_synthetic_prepared"]

RECIPE_FILE = "synthetic.json"
RAW_DIR = "raw"


@dataclass
class SyntheticSection:
    """A config's ``task.synthetic``: synthetic skulls made and prepared into ``data_root`` when none is there."""

    skulls: int = 4
    size: int = 64  # voxels per side
    seed: int = 0
    points: int = 4096  # surface points kept per volume when preparing
    split: str = "0.5,0.25,0.25"  # train, val, test ratios, grouped by skull
    family: str = "domes"  # the skull family (pointforge.data.synthetic.dataset.FAMILIES)

    # Called by the enclosing section's validate: an error raised while the config
    # loader tries the `SyntheticSection | None` union would be replaced by a generic one.
    def check(self, prefix: str, *, min_skulls: int = 1, why: str = "") -> None:
        """ConfigError for the first wrong key; ``min_skulls`` (and ``why``) as the task needs."""
        if self.family not in synthetic.FAMILIES:
            raise ConfigError(
                f"config key '{prefix}.family' must be one of {', '.join(synthetic.FAMILIES)}, got {self.family!r}"
            )
        if not min_skulls <= self.skulls <= 1000:
            raise ConfigError(f"config key '{prefix}.skulls' must be from {min_skulls} to 1000{why}, got {self.skulls}")
        if not MIN_SIZE <= self.size <= MAX_SIZE:
            raise ConfigError(
                f"config key '{prefix}.size' must be from {MIN_SIZE} to {MAX_SIZE} voxels, got {self.size}"
            )
        if self.seed < 0:
            raise ConfigError(f"config key '{prefix}.seed' must be 0 or more, got {self.seed}")
        if self.points < 1000:
            raise ConfigError(f"config key '{prefix}.points' must be at least 1000, got {self.points}")
        try:
            check_split(self.split)
        except ConfigError as err:
            raise ConfigError(f"config key '{prefix}.split': {err}") from None


def _recipe(skulls: int, size: int, seed: int, n_points: int, split: str, layout: str, family: str) -> dict:
    return {
        "family": str(family),
        "skulls": int(skulls),
        "size": int(size),
        "seed": int(seed),
        "n_points": int(n_points),
        "split": str(split),
        "layout": str(layout),
    }


def _check_recipe(root: Path, wanted: dict) -> None:
    recipe_path = root / RECIPE_FILE
    if not recipe_path.is_file():
        return  # a dataset prepared by hand: use it as it is
    try:
        found = json.loads(recipe_path.read_text())
    except (OSError, ValueError):
        raise DataError(f"{recipe_path} is unreadable; delete {root} to have it rebuilt") from None
    found.setdefault("family", "domes")  # recipes written before there was a second family
    differs = {k: (found.get(k), v) for k, v in wanted.items() if found.get(k) != v}
    if differs:
        detail = ", ".join(f"{k} {old!r} (asked {new!r})" for k, (old, new) in differs.items())
        raise ConfigError(
            f"{root} holds synthetic data made with other settings: {detail}; delete the folder to rebuild it, "
            "or point data_root elsewhere"
        )


def _holds_something(root: Path) -> bool:
    """Whether ``root`` is there to be used; an empty folder is built into (a rename may replace it)."""
    if not root.exists():
        return False
    if not root.is_dir():
        raise DataError(f"{root} exists and is not a folder; choose another data_root")
    return any(root.iterdir())


def _relocate_sources(prepared: Path, built_raw: Path, final_raw: Path) -> None:
    """Point the prepared files' records of their sources at the raw volumes' final place."""
    old, new = str(built_raw), str(final_raw)
    for meta_path in (prepared / "surfaces").rglob("*.json"):
        meta = json.loads(meta_path.read_text())
        if str(meta.get("source", "")).startswith(old):
            meta["source"] = new + meta["source"][len(old) :]
            atomic_write_text(meta_path, json.dumps(meta, indent=1))
    info_path = prepared / "dataset.json"
    info = json.loads(info_path.read_text())
    info["source_root"] = new
    atomic_write_text(info_path, json.dumps(info, indent=1))


def ensure_synthetic_prepared(
    root: str | os.PathLike,
    skulls: int,
    size: int,
    seed: int,
    n_points: int,
    log: Callable[[str], None] = print,
    *,
    split: str = "0.7,0.1,0.2",
    layout: str = "skullbreak",
    family: str = "domes",
    timeout_s: float = 3600.0,
) -> Path:
    """The prepared dataset folder ``root``, synthesised and prepared first if it does not exist.

    ``skulls`` synthetic skulls of ``family`` and ``size``³ voxels (:func:`pointforge.data.synthetic.dataset.synthesize`
    with ``seed`` and ``layout``), prepared with ``n_points`` surface points per
    volume and the seeded ``split`` (:func:`pointforge.data.prepare.prepare_dataset`).
    An existing non-empty ``root`` is returned as it is, unless it records a
    different recipe (ConfigError); an empty folder is built into. Safe to call from many processes at once (module docs).
    """
    root = Path(root)
    wanted = _recipe(skulls, size, seed, n_points, split, layout, family)
    if _holds_something(root):
        _check_recipe(root, wanted)
        return root
    parent = root.parent
    lock = parent / f".{root.name}.lock"
    with exclusive_lock(
        lock,
        timeout_s=timeout_s,
        on_wait=lambda: log(f"waiting for another process preparing {root}"),
        on_timeout=lambda: DataError(
            f"waited {timeout_s:.0f} s for another process building data beside {lock}; "
            "if none is running, delete the lock file and retry"
        ),
    ):
        if _holds_something(root):  # built while we waited
            _check_recipe(root, wanted)
            return root
        for stale in parent.glob(f".{root.name}.building-*"):  # left by a crashed builder; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        build = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=parent))
        try:
            started = time.perf_counter()
            log(
                f"no data at {root}: synthesising {skulls} {family} skull(s) of {size}^3 voxels (seed {seed}) "
                "and preparing them"
            )
            synthetic.synthesize(build / RAW_DIR, skulls, size, seed, layout=layout, family=family)
            result = prepare.prepare_dataset(
                build / RAW_DIR, build, n_points=n_points, split=split, seed=seed, workers=1
            )
            if not result.ok:
                raise DataError(f"preparing synthetic data failed: {result.failures[0]}")
            # Resolved: prepare records absolute sources, and a relative data_root must not leave them pointing
            # into the temporary folder.
            _relocate_sources(build, (build / RAW_DIR).resolve(), (root / RAW_DIR).resolve())
            atomic_write_text(build / RECIPE_FILE, json.dumps(wanted, indent=1))
            os.replace(build, root)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        log(
            f"prepared {len(result.cases)} synthetic case(s) in {root} in {time.perf_counter() - started:.1f} s "
            f"(split {result.split_counts})"
        )
    return root

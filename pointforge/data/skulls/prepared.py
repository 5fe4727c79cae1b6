"""A prepared dataset's index: ``cases.csv`` and ``dataset.json``, and the files they name.

A prepared dataset (written by :mod:`pointforge.data.prepare`) holds surface
points per volume under ``surfaces/`` mirroring the raw layout, complete-skull
masks under ``masks/``, ``cases.csv`` (one row per defective skull, with its
split) and ``dataset.json``.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pointforge.atomic import atomic_write_text
from pointforge.data.skulls.splits import SPLITS
from pointforge.errors import ConfigError, DataError


@dataclass
class PreparedCase:
    case_id: str
    skull_id: str
    defect: str
    split: str
    defective: str  # relative .npy path of the defective skull's surface points
    implant: str  # "" if absent
    complete: str  # "" if absent
    complete_mask: str  # "" if absent


class PreparedDataset:
    """Index of a prepared dataset folder (``cases.csv`` + metadata)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        manifest = self.root / "cases.csv"
        info = self.root / "dataset.json"
        if not manifest.exists() or not info.exists():
            raise DataError(
                f"{self.root}: not a prepared dataset (no cases.csv / dataset.json); "
                "run `pointforge data prepare RAW_ROOT --out DIR` first"
            )
        self.info = json.loads(info.read_text())
        with open(manifest, newline="") as fh:
            self.cases = [PreparedCase(**row) for row in csv.DictReader(fh)]
        # Opened memory maps by relative path: opening one (header parse, path checks)
        # cost as much as the rest of a PCDiff training item. Bounded, so a huge
        # dataset cannot exhaust the process's map count.
        self._maps: dict[str, np.ndarray] = {}

    def split(self, name: str, *, require: tuple[str, ...] = ("implant",)) -> list[PreparedCase]:
        if name not in SPLITS and name != "all":
            raise ConfigError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)} or all")
        chosen = [c for c in self.cases if name == "all" or c.split == name]
        return [c for c in chosen if all(getattr(c, field) for field in require)]

    def path(self, rel: str) -> Path:
        return self.root / rel

    _MAX_MAPS = 4096

    def __getstate__(self) -> dict:
        # A pickled memory map is a full copy of its data (data-loader workers under
        # ``spawn``): workers open their own.
        return {**self.__dict__, "_maps": {}}

    def points(self, rel: str, *, mmap: bool = True) -> np.ndarray:
        """The ``[N, 3]`` points of a case file: a read-only memory map (kept open), or a copy (``mmap=False``)."""
        if mmap and rel in self._maps:
            return self._maps[rel]
        path = self.path(rel)
        try:
            array = np.load(path, mmap_mode="r" if mmap else None)
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except ValueError as exc:
            raise DataError(f"{path}: unreadable point file ({exc}); delete it and re-run prepare") from None
        if mmap:
            if len(self._maps) >= self._MAX_MAPS:
                self._maps.clear()
            self._maps[rel] = array
        return array

    def meta(self, rel: str) -> dict:
        path = self.path(rel).with_suffix(".json")
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except ValueError as exc:
            raise DataError(f"{path}: unreadable metadata ({exc}); delete it and re-run prepare") from None

    def complete_mask(self, case: PreparedCase) -> np.ndarray:
        if not case.complete_mask:
            raise DataError(f"case {case.case_id} has no complete skull; the voxelisation target needs one")
        path = self.path(case.complete_mask)
        try:
            with np.load(path) as z:
                shape = tuple(int(s) for s in z["shape"])
                bits = np.unpackbits(z["bits"], count=int(np.prod(shape)))
        except FileNotFoundError:
            raise DataError(f"{path}: missing; re-run `pointforge data prepare` to complete the dataset") from None
        except (ValueError, KeyError, OSError) as exc:
            raise DataError(f"{path}: unreadable mask file ({exc}); delete it and re-run prepare") from None
        return bits.reshape(shape).astype(bool)

    def check_files(
        self, cases: list[PreparedCase], fields: tuple[str, ...], *, split: str, meta: bool = False
    ) -> None:
        """Stat every file ``cases`` name under ``fields`` (with ``meta``, the defective skull's .json too).

        One ``stat`` per file, so a training run finds a deleted or emptied file
        before its first step instead of in a loader worker hours later.
        Raises DataError naming the first bad file and how many there are.
        """
        bad: list[Path] = []
        for case in cases:
            rels = [getattr(case, name) for name in fields if getattr(case, name)]
            paths = [self.path(rel) for rel in rels]
            if meta and case.defective:
                paths.append(self.path(case.defective).with_suffix(".json"))
            for path in paths:
                try:
                    empty = os.stat(path).st_size == 0
                except OSError:
                    empty = True
                if empty:
                    bad.append(path)
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise DataError(
                f"{bad[0]}{more}: missing or empty ({len(bad)} of the {split!r} split's files); "
                "re-run `pointforge data prepare` with the same --out to complete the dataset"
            )


def write_manifest(root: Path, cases: list[PreparedCase]) -> None:
    fields = list(PreparedCase.__dataclass_fields__)
    lines = [",".join(fields)]
    for c in cases:
        row = asdict(c)
        lines.append(",".join(str(row[f]) for f in fields))
    atomic_write_text(root / "cases.csv", "\n".join(lines) + "\n")

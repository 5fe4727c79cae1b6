"""Raw dataset layouts: which volumes a SkullBreak or SkullFix folder holds, one case per defective skull.

Raw layouts (SkullBreak and SkullFix: Kodym et al., Data in Brief 2021):

* SkullBreak: ``complete_skull/NNN.nrrd``, ``defective_skull/<defect>/NNN.nrrd``,
  ``implant/<defect>/NNN.nrrd``.
* SkullFix: ``complete_skull/NNN.nrrd``, ``defective_skull/NNN.nrrd``,
  ``implant/NNN.nrrd``.

NIfTI files (``.nii``/``.nii.gz``) are accepted wherever NRRD is. ``implant`` and
``complete_skull`` may be absent (e.g. a challenge test set): such cases prepare
for inference only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pointforge.data.volumes import VOLUME_SUFFIXES
from pointforge.errors import ConfigError, DataError

LAYOUTS = ("skullbreak", "skullfix")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(VOLUME_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def volumes_in(folder: Path) -> dict[str, Path]:
    """The volume files directly in ``folder`` by stem (e.g. "000"), sorted; empty when it is no folder."""
    if not folder.is_dir():
        return {}
    found = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name.lower().endswith(VOLUME_SUFFIXES) and not p.name.startswith("."):
            found[_stem(p)] = p
    return found


@dataclass(frozen=True)
class RawCase:
    """One defective skull, with its implant and complete skull when present."""

    case_id: str  # unique in the dataset, e.g. "bilateral/000" or "000"
    skull_id: str  # the skull it belongs to; splits are grouped by this
    defect: str  # defect class, "" for SkullFix
    defective: Path
    implant: Path | None
    complete: Path | None


def detect_layout(root: str | os.PathLike) -> str:
    """'skullbreak' or 'skullfix', from the folders under ``root``; DataError otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the dataset's root folder")
    defective = root / "defective_skull"
    if not defective.is_dir():
        raise DataError(
            f"{root}: neither a SkullBreak nor a SkullFix layout (no 'defective_skull' folder); "
            "expected defective_skull/<defect>/NNN.nrrd (SkullBreak) or defective_skull/NNN.nrrd (SkullFix)"
        )
    has_subdirs = any(p.is_dir() and volumes_in(p) for p in defective.iterdir())
    has_files = bool(volumes_in(defective))
    if has_subdirs and not has_files:
        return "skullbreak"
    if has_files and not has_subdirs:
        return "skullfix"
    if has_files and has_subdirs:
        raise DataError(
            f"{defective}: holds both volume files and defect folders; a SkullBreak layout has only "
            "<defect>/ folders, a SkullFix layout only files"
        )
    raise DataError(f"{defective}: no .nrrd or .nii(.gz) volumes found")


def list_cases(root: str | os.PathLike, layout: str | None = None) -> tuple[str, list[RawCase]]:
    root = Path(root)
    layout = layout or detect_layout(root)
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    complete = volumes_in(root / "complete_skull")
    cases: list[RawCase] = []
    if layout == "skullbreak":
        for defect_dir in sorted(p for p in (root / "defective_skull").iterdir() if p.is_dir()):
            implants = volumes_in(root / "implant" / defect_dir.name)
            for stem, path in volumes_in(defect_dir).items():
                cases.append(
                    RawCase(
                        f"{defect_dir.name}/{stem}", stem, defect_dir.name, path, implants.get(stem), complete.get(stem)
                    )
                )
    else:
        implants = volumes_in(root / "implant")
        for stem, path in volumes_in(root / "defective_skull").items():
            cases.append(RawCase(stem, stem, "", path, implants.get(stem), complete.get(stem)))
    if not cases:
        raise DataError(f"{root}: no defective skull volumes found")
    return layout, cases

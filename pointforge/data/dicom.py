"""A CT DICOM series (a folder of its files, a zip of them, or the files' bytes) → the skull as a binary volume.

What is done, each step recorded in :attr:`CTSeries.notes` for the user to check:

* the files are one CT series (one SeriesInstanceUID, modality CT) of slices of
  one size, uncompressed or in a transfer syntax pydicom decodes without extra
  plugins; files that are not DICOM images (a README, a DICOMDIR) are skipped;
* Hounsfield units are ``stored value × RescaleSlope + RescaleIntercept``, per
  slice; a slice without these tags is refused (its values could be anything);
* bone is every voxel at or above :data:`BONE_HU` (300 HU: above soft tissue and
  blood, below cortical bone; metal, contrast and thick calcifications are bone
  too), and the skull is the largest 26-connected component of bone: a mandible,
  cervical spine or head rest touching it stays (a note says how far the kept
  bone reaches along the body), loose pieces go;
* the slices' geometry comes from their positions (:mod:`pointforge.data.ct_stack`):
  a gantry tilt or uneven spacing is resampled onto an even grid perpendicular
  to the slices; repeated slices, gaps and slices over 3 mm apart are refused;
* the mask is resampled to isotropic voxels of the finest spacing (linear
  interpolation, threshold 0.5), in DICOM's patient coordinates (LPS) and the
  slices' own directions, so it shares the series' Frame of Reference.

Private tags are ignored. Nothing from a zip becomes a path: members are read into memory.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from pointforge.data.ct_stack import StackGeometry, restack, stack_geometry
from pointforge.data.prepare import resample_isotropic
from pointforge.data.volumes import Volume, read_binary_volume
from pointforge.errors import DataError

__all__ = [
    "BONE_HU",
    "CTSeries",
    "is_dicom_series",
    "read_ct_series",
    "read_skull_input",
    "ct_series_from_bytes",
    "bone_mask",
]

BONE_HU = 300.0
_BODY_AXIS_NOTE_MM = 180.0  # a cranium alone is shorter than this head to foot; longer bone has more joined to it


@dataclass
class CTSeries:
    skull: Volume  # bool, isotropic, LPS, the series' Frame of Reference
    headers: list[Any]  # the slices' pydicom datasets without pixel data, first to last along the normal
    notes: list[str] = field(default_factory=list)

    @property
    def frame_of_reference_uid(self) -> str:
        return str(self.headers[0].get("FrameOfReferenceUID", ""))


def is_dicom_series(path: Path) -> bool:
    """Whether ``path`` is a zip, or a folder holding a DICOM file (a ``DICM`` preamble) at its top level."""
    path = Path(path)
    if path.is_file():
        return zipfile.is_zipfile(path)
    if not path.is_dir():
        return False
    for child in sorted(path.iterdir())[:50]:
        if child.is_file():
            with open(child, "rb") as handle:
                if handle.read(132)[128:132] == b"DICM":
                    return True
    return False


def read_ct_series(path: Path, *, max_voxels: int | None = None) -> CTSeries:
    """The skull of the CT series in the folder (every file under it) or zip at ``path``."""
    path = Path(path)
    if path.is_dir():
        return ct_series_from_bytes((f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()), max_voxels)
    with zipfile.ZipFile(path) as archive:
        members = [info for info in archive.infolist() if not info.is_dir()]
        return ct_series_from_bytes((archive.read(info) for info in members), max_voxels)


def read_skull_input(path: Path) -> tuple[Volume, CTSeries | None]:
    """The defective skull of an input (a binary NRRD/NIfTI mask, or a CT series as a folder or zip), and the
    series it was made from (None for a mask): what ``generate`` reads, and the print-ready STL after it."""
    if is_dicom_series(path):
        series = read_ct_series(path)
        return series.skull, series
    return read_binary_volume(path), None


def ct_series_from_bytes(files: Iterable[bytes], max_voxels: int | None = None) -> CTSeries:
    """The skull of the one CT series among ``files`` (each one file's bytes; non-DICOM ones are skipped)."""
    slices = _ct_slices(files)
    try:
        geometry = stack_geometry(
            slices[0].ImageOrientationPatient, [ds.ImagePositionPatient for ds in slices], slices[0].PixelSpacing
        )
    except (AttributeError, ValueError, TypeError):
        raise DataError("the series lacks ImageOrientationPatient, ImagePositionPatient or PixelSpacing") from None
    ordered = [slices[i] for i in geometry.order]
    rows, cols = int(ordered[0].Rows), int(ordered[0].Columns)
    if max_voxels is not None and rows * cols * len(ordered) > max_voxels:
        raise DataError(f"the series holds {rows * cols * len(ordered):,} voxels; the service takes {max_voxels:,}")
    notes: list[str] = []
    mask = bone_mask(_hounsfield(ordered, notes), notes=notes)
    skull = _on_isotropic_grid(mask, geometry, notes)
    _note_extent(skull, notes)
    for ds in ordered:
        del ds.PixelData
    return CTSeries(skull, ordered, notes)


def _ct_slices(files: Iterable[bytes]) -> list:
    import pydicom
    from pydicom.errors import InvalidDicomError

    found = []
    for blob in files:
        try:
            ds = pydicom.dcmread(io.BytesIO(blob))
        except (InvalidDicomError, EOFError, OSError, ValueError, KeyError):
            continue  # a README, a DICOMDIR or thumbnails beside the series
        if "PixelData" in ds:
            found.append(ds)
    if not found:
        raise DataError("no DICOM images found; give one CT series (a folder or zip of its files) or a NRRD/NIfTI mask")
    series = {str(ds.get("SeriesInstanceUID", "")) for ds in found}
    if len(series) > 1:
        raise DataError(f"the files hold {len(series)} DICOM series; give one CT series at a time")
    modality = str(found[0].get("Modality", ""))
    if modality != "CT":
        raise DataError(f"the series is {modality or 'of no modality'}, not CT; bone is found by Hounsfield units")
    if len(found) < 3:
        raise DataError(f"the series has {len(found)} slice(s); a skull needs a stack of slices")
    if len({(int(ds.Rows), int(ds.Columns)) for ds in found}) > 1:
        raise DataError("the slices differ in size; give one series of one reconstruction")
    return found


def _hounsfield(ordered: list, notes: list[str]) -> np.ndarray:
    """``[col, row, slice]`` float32 HU; a slice without its rescale tags is refused."""
    rows, cols = int(ordered[0].Rows), int(ordered[0].Columns)
    hounsfield = np.empty((cols, rows, len(ordered)), np.float32)
    rescales = set()
    for k, ds in enumerate(ordered):
        if "RescaleSlope" not in ds or "RescaleIntercept" not in ds:
            raise DataError(
                "a slice has no RescaleSlope/RescaleIntercept, so its Hounsfield units are unknown; "
                "export the series with its rescale tags"
            )
        try:
            pixels = ds.pixel_array
        except Exception as exc:  # pydicom's decoders raise many types for unsupported syntaxes
            raise DataError(
                f"a slice cannot be decoded ({type(exc).__name__}); export the series uncompressed"
            ) from None
        slope, intercept = float(ds.RescaleSlope), float(ds.RescaleIntercept)
        rescales.add((slope, intercept))
        hounsfield[:, :, k] = pixels.T.astype(np.float32) * slope + intercept
    said = ", ".join(f"× {s:g} + {i:g}" for s, i in sorted(rescales)[:3])
    notes.append(f"Hounsfield units: stored value {said} (RescaleSlope, RescaleIntercept)")
    return hounsfield


def bone_mask(hounsfield: np.ndarray, threshold: float = BONE_HU, *, notes: list[str] | None = None) -> np.ndarray:
    """Voxels at or above ``threshold`` HU, only the largest 26-connected component."""
    from scipy.ndimage import label

    bone = hounsfield >= threshold
    labels, count = label(bone, structure=np.ones((3, 3, 3), bool))
    if count == 0:
        raise DataError(f"no voxel reaches {threshold:g} HU; is this a CT with its rescale tags?")
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    kept = int(sizes.argmax())
    if notes is not None:
        left = int(sizes.sum() - sizes[kept])
        notes.append(
            f"bone ≥ {threshold:g} HU: kept the largest connected piece ({int(sizes[kept]):,} voxels), "
            f"left out {count - 1} smaller piece(s) ({left:,} voxels)"
        )
    return labels == kept


def _on_isotropic_grid(mask: np.ndarray, geometry: StackGeometry, notes: list[str]) -> Volume:
    step = geometry.step_mm
    spacing = (*geometry.pixel_mm, step)
    origin = geometry.first_position
    if geometry.sheared or not geometry.even:
        step = min(min(geometry.pixel_mm), step)
        what = []
        if geometry.sheared:
            what.append(f"a gantry tilt of {geometry.tilt_degrees:.1f}° (the slices are shifted in their planes)")
        if not geometry.even:
            steps = np.diff(geometry.depth_mm)
            what.append(f"uneven slice spacing ({steps.min():.3g}-{steps.max():.3g} mm)")
        mask, origin = restack(mask, geometry, step)
        spacing = (*geometry.pixel_mm, step)
        notes.append(
            f"{' and '.join(what)}: the stack was resampled onto an even grid perpendicular to the slices, "
            f"{step:.3g} mm apart"
        )
    volume = Volume(mask, spacing=spacing, origin=tuple(float(v) for v in origin), direction=geometry.direction)  # type: ignore[arg-type]
    finest = min(spacing)
    if max(spacing) - finest > 1e-3 * finest:
        data, _ = resample_isotropic(volume, finest)
        volume = Volume(data, spacing=(finest,) * 3, origin=volume.origin, direction=geometry.direction)
        notes.append(
            f"resampled to isotropic {finest:.3g} mm voxels (from {' × '.join(f'{s:.3g}' for s in spacing)} mm)"
        )
    return volume


def _note_extent(skull: Volume, notes: list[str]) -> None:
    """How far the kept bone reaches head to foot (LPS z): a cranium alone stays under 180 mm."""
    index = np.argwhere(skull.data)
    if index.size == 0:
        raise DataError("no bone is left after resampling; is this a head CT?")
    height = skull.voxel_to_physical(index)[:, 2]
    reach = float(height.max() - height.min())
    if reach > _BODY_AXIS_NOTE_MM:
        notes.append(
            f"the kept bone reaches {reach:.0f} mm head to foot: a mandible, cervical spine or head rest is joined "
            "to the skull; the models were trained on skulls without them: check the 3-D view"
        )

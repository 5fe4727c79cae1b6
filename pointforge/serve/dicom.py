"""A CT DICOM series in a zip → the skull as a binary volume on an isotropic grid.

What is assumed (docs/serve.md says what a user must check):

* the zip holds one CT series (one SeriesInstanceUID, modality CT) of parallel,
  evenly spaced axial-or-otherwise slices of one size, uncompressed or in a
  transfer syntax pydicom decodes without extra plugins;
* Hounsfield units are ``stored value × RescaleSlope + RescaleIntercept``, and
  bone is every voxel at or above :data:`BONE_HU` (300 HU: above soft tissue and
  blood, below cortical bone; metal, contrast and thick calcifications are bone too);
* the skull is the largest connected component of bone (26-connectivity): the
  cervical spine, if it touches the skull, stays; loose fragments go;
* the mask is resampled to isotropic voxels of the finest spacing (linear
  interpolation, threshold 0.5, :func:`pointforge.data.prepare.resample_isotropic`),
  so the implant comes back on that grid (origin and directions of the series,
  in DICOM's patient coordinates, LPS), not on the CT's own.

Members are read into memory one by one; nothing from the zip becomes a path.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np

from pointforge.data.prepare import resample_isotropic
from pointforge.data.volumes import Volume
from pointforge.errors import DataError

__all__ = ["BONE_HU", "read_series_zip", "bone_mask"]

BONE_HU = 300.0
_SPACING_TOLERANCE = 0.1  # slices further than 10 % from the median spacing: a gap or a second stack


def _slices(path: Path, members: list[zipfile.ZipInfo]) -> list:
    import pydicom
    from pydicom.errors import InvalidDicomError

    found = []
    with zipfile.ZipFile(path) as archive:
        for info in members:
            try:
                ds = pydicom.dcmread(io.BytesIO(archive.read(info)))
            except (InvalidDicomError, EOFError, OSError, ValueError):
                continue  # a README, a DICOMDIR or thumbnails beside the series
            if "PixelData" in ds:
                found.append(ds)
    if not found:
        raise DataError("the zip holds no DICOM images; upload a zip of one CT series (or a NRRD/NIfTI mask)")
    series = {str(ds.get("SeriesInstanceUID", "")) for ds in found}
    if len(series) > 1:
        raise DataError(f"the zip holds {len(series)} DICOM series; upload one CT series per zip")
    modality = str(found[0].get("Modality", ""))
    if modality != "CT":
        raise DataError(f"the series is {modality or 'of no modality'}, not CT; bone is found by Hounsfield units")
    if len(found) < 3:
        raise DataError(f"the series has {len(found)} slice(s); a skull needs a stack of slices")
    return found


def _geometry(slices: list) -> tuple[list, np.ndarray, tuple[float, float, float], np.ndarray]:
    """Slices sorted along their normal; the direction matrix (columns: along a row, down a column,
    the normal), the spacing and the first slice's position."""
    try:
        orientation = np.asarray(slices[0].ImageOrientationPatient, dtype=np.float64)
        positions = np.asarray([ds.ImagePositionPatient for ds in slices], dtype=np.float64)
        row_mm, col_mm = (float(v) for v in slices[0].PixelSpacing)
    except (AttributeError, ValueError, TypeError):
        raise DataError("the series lacks ImageOrientationPatient, ImagePositionPatient or PixelSpacing") from None
    along_row, down_col = orientation[:3], orientation[3:]
    normal = np.cross(along_row, down_col)
    order = np.argsort(positions @ normal)
    depth = (positions @ normal)[order]
    steps = np.diff(depth)
    step = float(np.median(steps))
    if step <= 0 or np.abs(steps - step).max() > _SPACING_TOLERANCE * step:
        raise DataError(
            f"the slices are not evenly spaced (steps {steps.min():.3g}-{steps.max():.3g} mm); "
            "upload one complete stack without gaps or repeated slices"
        )
    direction = np.stack([along_row, down_col, normal], axis=1)
    return [slices[i] for i in order], direction, (col_mm, row_mm, step), positions[order[0]]


def bone_mask(hounsfield: np.ndarray, threshold: float = BONE_HU) -> np.ndarray:
    """Voxels at or above ``threshold`` HU, only the largest 26-connected component."""
    from scipy.ndimage import label

    bone = hounsfield >= threshold
    labels, count = label(bone, structure=np.ones((3, 3, 3), bool))
    if count == 0:
        raise DataError(f"no voxel reaches {threshold:g} HU; is this a CT with its rescale tags?")
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(sizes.argmax())


def read_series_zip(path: Path, members: list[zipfile.ZipInfo], *, max_voxels: int) -> Volume:
    """The skull of the CT series in the zip at ``path`` as a bool volume on an isotropic grid."""
    slices = _slices(path, members)
    ordered, direction, spacing, origin = _geometry(slices)
    rows, cols = int(ordered[0].Rows), int(ordered[0].Columns)
    if rows * cols * len(ordered) > max_voxels:
        raise DataError(f"the series holds {rows * cols * len(ordered):,} voxels; the service takes {max_voxels:,}")
    hounsfield = np.empty((cols, rows, len(ordered)), np.float32)
    for k, ds in enumerate(ordered):
        if (int(ds.Rows), int(ds.Columns)) != (rows, cols):
            raise DataError("the slices differ in size; upload one series")
        try:
            pixels = ds.pixel_array
        except Exception as exc:  # pydicom's decoders raise many types for unsupported syntaxes
            raise DataError(
                f"a slice cannot be decoded ({type(exc).__name__}); export the series uncompressed"
            ) from None
        slope, intercept = float(ds.get("RescaleSlope", 1)), float(ds.get("RescaleIntercept", 0))
        hounsfield[:, :, k] = pixels.T.astype(np.float32) * slope + intercept
    mask = bone_mask(hounsfield)
    volume = Volume(
        mask, spacing=spacing, origin=(float(origin[0]), float(origin[1]), float(origin[2])), direction=direction
    )
    finest = min(spacing)
    if max(spacing) - finest > 1e-3 * finest:
        data, _ = resample_isotropic(volume, finest)
        volume = Volume(data, spacing=(finest,) * 3, origin=volume.origin, direction=direction)
    return volume

"""Reading and writing 3-D volumes (NRRD, NIfTI) with their geometry kept exactly.

A :class:`Volume` is an array plus the geometry that places it in physical space:
``spacing`` (mm per voxel along each array axis), ``origin`` (physical position of
voxel (0, 0, 0)) and ``direction`` (3×3, column ``i`` is the unit vector of array
axis ``i``). The physical position of voxel index ``ijk`` is
``origin + direction @ (spacing * ijk)``.

Format-specific header fields that we do not interpret are carried in
``Volume.header`` so that a volume read and written back keeps them (an implant
written for a SkullBreak case has the case's exact header).

NRRD I/O is pynrrd, NIfTI I/O is nibabel; this module only adds the geometry
bookkeeping, validation with one clear error per bad file, and atomic writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.data.nrrd_deflate import write_gzip_nrrd
from pointforge.errors import DataError

NRRD_SUFFIXES = (".nrrd", ".nhdr")
NIFTI_SUFFIXES = (".nii", ".nii.gz")
VOLUME_SUFFIXES = NRRD_SUFFIXES + NIFTI_SUFFIXES


@dataclass
class Volume:
    data: np.ndarray
    spacing: tuple[float, float, float] = (1.0, 1.0, 1.0)
    origin: tuple[float, float, float] = (0.0, 0.0, 0.0)
    direction: np.ndarray = field(default_factory=lambda: np.eye(3))
    header: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    foreground: float | None = None  # a binary mask's foreground value as read (e.g. 255), kept for writing outputs

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.data.shape)  # type: ignore[return-value]

    def affine(self) -> np.ndarray:
        """4×4 matrix mapping homogeneous voxel indices to physical coordinates (mm)."""
        a = np.eye(4)
        a[:3, :3] = np.asarray(self.direction, dtype=np.float64) * np.asarray(self.spacing, dtype=np.float64)[None, :]
        a[:3, 3] = self.origin
        return a

    def voxel_to_physical(self, ijk: np.ndarray) -> np.ndarray:
        ijk = np.asarray(ijk, dtype=np.float64)
        a = self.affine()
        return ijk @ a[:3, :3].T + a[:3, 3]

    def physical_to_voxel(self, xyz: np.ndarray) -> np.ndarray:
        xyz = np.asarray(xyz, dtype=np.float64)
        a = self.affine()
        return (xyz - a[:3, 3]) @ np.linalg.inv(a[:3, :3]).T

    def with_data(self, data: np.ndarray) -> "Volume":
        """Same geometry and header, new voxels (e.g. an implant for this skull)."""
        if tuple(data.shape) != self.shape:
            raise DataError(f"new data has shape {tuple(data.shape)}, expected {self.shape} to keep the geometry")
        return replace(self, data=data, path=None)


def volume_format(path: str | os.PathLike) -> str:
    name = str(path).lower()
    if name.endswith(NRRD_SUFFIXES):
        return "nrrd"
    if name.endswith(NIFTI_SUFFIXES):
        return "nifti"
    raise DataError(f"{path}: unknown volume format; use .nrrd, .nhdr, .nii or .nii.gz")


def as_triple(values: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """Three numbers as plain floats, the form of a volume's spacing and origin."""
    x, y, z = (float(v) for v in values)
    return x, y, z


# --------------------------------------------------------------------------- reading


def read_volume(path: str | os.PathLike) -> Volume:
    """Read a 3-D NRRD or NIfTI volume with its geometry. Raises DataError naming the file."""
    path = Path(path)
    fmt = volume_format(path)
    if not path.exists():
        raise DataError(f"{path}: no such file; check the path")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, expected a volume file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: file is empty (0 bytes); re-export or re-copy it")
    try:
        vol = _read_nrrd(path) if fmt == "nrrd" else _read_nifti(path)
    except DataError:
        raise
    except Exception as exc:  # the readers raise many types for truncated/corrupt files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{path}: cannot read {fmt.upper()} ({reason}); the file may be truncated or corrupt — re-export or re-copy it"
        ) from None
    if vol.data.ndim != 3:
        raise DataError(f"{path}: expected a 3-D volume, found {vol.data.ndim}-D data of shape {tuple(vol.data.shape)}")
    if vol.data.size == 0 or min(vol.data.shape) == 0:
        raise DataError(f"{path}: volume has no voxels (shape {tuple(vol.data.shape)})")
    vol.path = path
    return vol


def read_binary_volume(path: str | os.PathLike, *, allow_empty: bool = False) -> Volume:
    """Read a binary mask (values 0/1, 0/255, or any 0/k, or bool) as a bool volume.

    A volume with more than two distinct values, or (unless ``allow_empty``) no
    foreground voxel at all, raises DataError naming the file.
    """
    vol = read_volume(path)
    raw = vol.data
    vol.data = to_binary(raw, name=str(path))
    if vol.data.any() and raw.dtype != bool:
        value = raw.max()  # to_binary checked that every foreground voxel holds this one value
        vol.foreground = int(value) if float(value).is_integer() else float(value)
    if not allow_empty and not vol.data.any():
        raise DataError(f"{path}: binary volume is empty (no foreground voxel); is this the right file?")
    return vol


def to_binary(data: np.ndarray, *, name: str = "volume") -> np.ndarray:
    if data.dtype == bool:
        return data
    if not np.issubdtype(data.dtype, np.number):
        raise DataError(f"{name}: voxel type {data.dtype} is not numeric")
    # Binary means every voxel is 0 or the maximum: two linear passes, where np.unique would
    # sort all 512³ values. np.unique runs only to name the values of a volume that fails.
    low, high = data.min(), data.max()
    if low == high or (low == 0 and np.count_nonzero(data) == np.count_nonzero(data == high)):
        return data != 0
    values = np.unique(data)
    if values.size > 2 or (values.size == 2 and values[0] != 0):
        shown = ", ".join(f"{v:g}" for v in values[:6]) + (", ..." if values.size > 6 else "")
        raise DataError(
            f"{name}: not a binary mask (values {shown}); expected 0 for background and one foreground value"
        )
    return data != 0


def _read_nrrd(path: Path) -> Volume:
    import nrrd

    data, header = nrrd.read(str(path), index_order="F")
    # pynrrd returns a Fortran-ordered view; the pipeline's arrays are C-ordered, and mixing the
    # two makes every whole-volume operation between them a strided one.
    data = transposed_copy(data.T)
    header = dict(header)
    ndim = int(header.get("dimension", data.ndim))
    spacing = np.ones(3)
    direction = np.eye(3)
    origin = np.zeros(3)
    dirs = header.get("space directions")
    if dirs is not None and ndim == 3:
        dirs = np.asarray(dirs, dtype=np.float64)
        if dirs.shape == (3, 3) and np.all(np.isfinite(dirs)):
            norms = np.linalg.norm(dirs, axis=1)
            if np.any(norms == 0):
                raise DataError(f"{path}: 'space directions' has a zero vector; the header is broken")
            spacing = norms
            direction = (dirs / norms[:, None]).T
    elif "spacings" in header and ndim == 3:
        sp = np.asarray(header["spacings"], dtype=np.float64)
        if sp.shape == (3,) and np.all(np.isfinite(sp)) and np.all(sp > 0):
            spacing = sp
    if header.get("space origin") is not None and ndim == 3:
        origin = np.asarray(header["space origin"], dtype=np.float64).reshape(-1)[:3]
        if origin.shape != (3,):
            raise DataError(f"{path}: 'space origin' has {origin.size} values for 3-D data; the header is broken")
    return Volume(
        data=data,
        spacing=as_triple(spacing),
        origin=as_triple(origin),
        direction=direction,
        header={"format": "nrrd", "nrrd": header},
    )


def _read_nifti(path: Path) -> Volume:
    import nibabel as nib

    img = nib.load(str(path))
    if not isinstance(img, nib.spatialimages.SpatialImage):
        raise DataError(f"{path}: holds no NIfTI image (nibabel read a {type(img).__name__}); re-export it as NIfTI")
    data = np.asanyarray(img.dataobj)
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    affine = np.asarray(img.affine, dtype=np.float64)
    lin = affine[:3, :3]
    spacing = np.linalg.norm(lin, axis=0)
    if np.any(spacing == 0):
        raise DataError(f"{path}: the NIfTI affine has a zero axis; the header is broken")
    direction = lin / spacing[None, :]
    data = np.asarray(data)
    if data.ndim == 3 and not data.flags.c_contiguous and data.flags.f_contiguous:
        data = transposed_copy(data.T)  # nibabel's arrays are Fortran-ordered; the pipeline's are C-ordered
    return Volume(
        data=data,
        spacing=as_triple(spacing),
        origin=as_triple(affine[:3, 3]),
        direction=direction,
        header={"format": "nifti", "nifti_header": img.header.copy()},
    )


# --------------------------------------------------------------------------- writing


def write_volume(
    path: str | os.PathLike,
    volume: Volume | np.ndarray,
    *,
    spacing: tuple[float, float, float] | None = None,
    origin: tuple[float, float, float] | None = None,
    direction: np.ndarray | None = None,
    compression_level: int = 1,
) -> Path:
    """Write a volume atomically. A bool array is stored as uint8 0/1.

    ``volume`` may be a :class:`Volume` (its geometry and kept header are written)
    or a bare array with the geometry given by keyword.
    """
    path = Path(path)
    fmt = volume_format(path)
    if isinstance(volume, np.ndarray):
        volume = Volume(
            data=volume,
            spacing=as_triple(spacing) if spacing is not None else (1.0, 1.0, 1.0),
            origin=as_triple(origin) if origin is not None else (0.0, 0.0, 0.0),
            direction=np.asarray(direction) if direction is not None else np.eye(3),
        )
    else:
        overrides: dict[str, Any] = {
            k: v for k, v in (("spacing", spacing), ("origin", origin), ("direction", direction)) if v is not None
        }
        if overrides:
            volume = replace(volume, **overrides)
    data = volume.data
    if data.ndim != 3:
        raise DataError(f"{path}: can only write 3-D volumes, got shape {tuple(data.shape)}")
    if data.dtype == bool:
        data = data.astype(np.uint8)
    suffix = ".nii.gz" if str(path).lower().endswith(".nii.gz") else path.suffix
    with atomic_path(path, suffix=suffix) as tmp:
        if fmt == "nrrd":
            _write_nrrd(str(tmp), data, volume, compression_level)
        else:
            _write_nifti(str(tmp), data, volume)
    return path


def _write_nrrd(tmp: str, data: np.ndarray, volume: Volume, compression_level: int) -> None:
    kept = dict(volume.header.get("nrrd", {})) if volume.header.get("format") == "nrrd" else {}
    # Fields that describe the data itself are rewritten from the array; the rest is kept.
    for key in (
        "type",
        "dimension",
        "sizes",
        "endian",
        "encoding",
        "data file",
        "datafile",
        "line skip",
        "byte skip",
        "spacings",
        "space dimension",
        "space",
        "space directions",
        "space origin",
        "kinds",
    ):
        kept.pop(key, None)
    header = dict(kept)
    header["space"] = volume.header.get("nrrd", {}).get("space", "left-posterior-superior")
    header["kinds"] = ["domain", "domain", "domain"]
    direction = np.asarray(volume.direction, dtype=np.float64)
    header["space directions"] = (direction * np.asarray(volume.spacing, dtype=np.float64)[None, :]).T
    header["space origin"] = np.asarray(volume.origin, dtype=np.float64)
    # NRRD stores the first axis fastest. The transposed array in C order holds the same bytes as
    # pynrrd's index_order="F" would write, without its whole-volume transposing copy (tobytes("F"),
    # several times slower than the blocked copy at 512³: docs/experiments/implant.md); it is
    # deflated by ISA-L in place, under pynrrd's header (pointforge.data.nrrd_deflate).
    write_gzip_nrrd(tmp, transposed_copy(data), header, compression_level)


def transposed_copy(data: np.ndarray, block: int = 16) -> np.ndarray:
    """``data.T`` as a C-contiguous array, copied in cache-sized blocks (4x faster than NumPy's copy at 512³).

    For a C-ordered volume that is its bytes in Fortran order (what NRRD stores); for a
    Fortran-ordered one (what pynrrd reads), ``transposed_copy(data.T)`` is its C-ordered copy.
    Only the box of the voxels whose bytes are not all zero is copied (:func:`nonzero_box`); the
    rest of the copy is zeros from the start, so an implant in a 512³ grid costs its box.
    """
    flipped = data.T
    if flipped.flags.c_contiguous:
        return flipped
    if flipped.ndim != 3:
        out = np.empty(flipped.shape, dtype=data.dtype)
        out[...] = flipped
        return out
    box = nonzero_box(data)
    out = np.zeros(flipped.shape, dtype=data.dtype)  # untouched pages stay the kernel's zero page
    if box is None:
        return out
    source, target = flipped[box[::-1]], out[box[::-1]]
    for i in range(0, target.shape[0], block):
        for k in range(0, target.shape[2], block):
            target[i : i + block, :, k : k + block] = source[i : i + block, :, k : k + block]
    return out


def nonzero_box(data: np.ndarray) -> tuple[slice, slice, slice] | None:
    """The box of a C-contiguous 3-D array's voxels whose bytes are not all zero (None: none is).

    Outside it every byte is zero (a float -0.0 counts as non-zero, so zeros written
    there give the same bytes). One linear pass over the rows, then one over the box.
    """
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    n0, n1, n2 = data.shape
    raw = data.reshape(n0 * n1, n2).view(np.uint8)
    words = raw.view(np.uint64) if raw.shape[1] % 8 == 0 else raw
    rows = words.any(axis=1).reshape(n0, n1)
    present_i, present_j = np.flatnonzero(rows.any(axis=1)), np.flatnonzero(rows.any(axis=0))
    if present_i.size == 0:
        return None
    i, j = slice(present_i[0], present_i[-1] + 1), slice(present_j[0], present_j[-1] + 1)
    voxels = data[i, j].view(np.uint8).reshape(i.stop - i.start, j.stop - j.start, n2, -1)
    present_k = np.flatnonzero(voxels.any(axis=(0, 1, 3)))
    return i, j, slice(present_k[0], present_k[-1] + 1)


def _write_nifti(tmp: str, data: np.ndarray, volume: Volume) -> None:
    import nibabel as nib

    kept = volume.header.get("nifti_header") if volume.header.get("format") == "nifti" else None
    img = nib.Nifti1Image(data, volume.affine(), header=kept.copy() if kept is not None else None)
    img.set_data_dtype(data.dtype)
    nib.save(img, tmp)

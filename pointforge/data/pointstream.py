"""Point clouds read and written in chunks, for clouds larger than memory.

:func:`open_cloud` gives a :class:`CloudSource`: the point count, storage
precision and LAS geometry from the header, and :meth:`CloudSource.chunks`
that yields float64 ``[n, 3]`` blocks of at most ``size`` points in file order,
holding exactly what :func:`pointforge.data.pointio.read_points` would. LAS/LAZ
are decompressed chunk by chunk (laspy's chunk iterator) and ``.npy`` is
memory-mapped, so neither is ever whole in memory; a ``.ply`` is read whole
(its chunks are slices).

:func:`cloud_writer` writes a cloud of a known number of points block by
block: ``.npy`` into a memory-mapped file, binary ``.ply`` and LAS/LAZ (laspy's
writer, the given geometry: scales, offsets, point format, version, CRS
records) appended. Like :func:`~pointforge.data.pointio.write_points` it
writes a temporary file renamed into place only once every point is in.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.data.pointio import (
    LasGeometry,
    _is_format_error,
    _storage_dtype,
    count_points,
    las_geometry,
    las_header,
    point_format,
    read_points,
)
from pointforge.errors import DataError

__all__ = ["CHUNK_POINTS", "CloudSource", "open_cloud", "cloud_writer"]

CHUNK_POINTS = 1 << 20
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class CloudSource:
    """A point cloud file to read in chunks (module docs)."""

    path: Path
    fmt: str
    count: int
    dtype: np.dtype
    las: Optional[LasGeometry] = None

    def chunks(self, size: int = CHUNK_POINTS) -> Iterator[np.ndarray]:
        try:
            yield from self._chunks(size)
        except DataError:
            raise
        except Exception as err:
            if not _is_format_error(err):
                raise
            raise DataError(f"{self.path}: cannot read it ({err}); is it a valid {self.fmt.upper()} file?") from None

    def _chunks(self, size: int) -> Iterator[np.ndarray]:
        if self.fmt in ("las", "laz"):
            yield from self._las_chunks(size)
            return
        if self.fmt == "npy":
            array = np.load(self.path, mmap_mode="r", allow_pickle=False)
            for start in range(0, self.count, size):
                part = array[start : start + size]
                xyz = np.stack([part[a] for a in "xyz"], axis=1) if array.dtype.names else part[:, :3]
                yield self._finite(np.ascontiguousarray(xyz, dtype=np.float64))
            return
        xyz = read_points(self.path).xyz
        for start in range(0, len(xyz), size):
            yield xyz[start : start + size]

    def _las_chunks(self, size: int) -> Iterator[np.ndarray]:
        import laspy

        assert self.las is not None
        scales, offsets = np.asarray(self.las.scales), np.asarray(self.las.offsets)
        seen = 0
        with laspy.open(self.path) as reader:
            for points in reader.chunk_iterator(size):
                ints = np.stack([np.asarray(points.X), np.asarray(points.Y), np.asarray(points.Z)], axis=1)
                seen += len(ints)
                yield self._finite(ints.astype(np.float64) * scales + offsets)
        if seen != self.count:
            raise DataError(
                f"{self.path}: holds {seen} of the {self.count} points its header announces; the file is truncated"
            )

    def _finite(self, xyz: np.ndarray) -> np.ndarray:
        if not np.isfinite(xyz).all():
            raise DataError(f"{self.path}: point cloud has NaN or infinite coordinates; clean the file first")
        return xyz


def _npy_dtype(path: Path) -> np.dtype:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.dtype.names:
        if any(n not in array.dtype.names for n in "xyz") or array.ndim != 1:
            raise DataError(f"{path}: structured array needs 1-D x, y, z fields")
        kinds = {array.dtype[n] for n in "xyz"}
        return _storage_dtype(kinds.pop()) if len(kinds) == 1 else np.dtype(np.float64)
    if array.ndim != 2 or array.shape[1] < 3:
        raise DataError(f"{path}: expected an [N, 3] array of coordinates, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise DataError(f"{path}: coordinates must be numbers, got dtype {array.dtype}")
    return _storage_dtype(array.dtype)


def open_cloud(path: str | os.PathLike) -> CloudSource:
    """A :class:`CloudSource` for ``path``, from its header (DataError naming the file on any problem)."""
    fmt = point_format(path)
    path = Path(path)
    count = count_points(path)  # also: the file exists and its header reads
    if fmt == "npy":
        return CloudSource(path, fmt, count, _npy_dtype(path))
    if fmt == "ply":
        return CloudSource(path, fmt, count, read_points(path).dtype)
    import laspy

    try:
        with laspy.open(path) as reader:
            geometry = las_geometry(reader.header)
    except Exception as err:
        if not _is_format_error(err):
            raise
        raise DataError(f"{path}: cannot read the header ({err}); is it a valid {fmt.upper()} file?") from None
    return CloudSource(path, fmt, count, np.dtype(np.float64), geometry)


@contextlib.contextmanager
def cloud_writer(
    path: str | os.PathLike, total: int, *, dtype: np.dtype | type = np.float64, las: Optional[LasGeometry] = None
) -> Iterator[Callable[[np.ndarray], None]]:
    """Yields ``write(xyz [n, 3])``; the file appears at ``path`` once ``total`` points are written (module docs).

    ``dtype`` applies to npy/ply, ``las`` (required for las/laz) to LAS/LAZ.
    """
    path = Path(path)
    fmt = point_format(path)
    if fmt in ("las", "laz") and las is None:
        raise ValueError("a LAS/LAZ output needs its geometry (scales and offsets)")
    written = 0
    with atomic_path(path, suffix=path.suffix) as tmp, _appender(fmt, tmp, total, np.dtype(dtype), las) as append:

        def write(xyz: np.ndarray) -> None:
            nonlocal written
            if written + len(xyz) > total:
                raise ValueError(f"{path}: more than the {total} points announced")
            append(np.asarray(xyz), written, path)
            written += len(xyz)

        yield write
        if written != total:
            raise ValueError(f"{path}: {written} of the {total} points announced were written")


@contextlib.contextmanager
def _appender(fmt: str, tmp: Path, total: int, dtype: np.dtype, las: Optional[LasGeometry]) -> Iterator[Any]:
    if fmt == "npy":
        mapped = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total, 3))
        yield lambda xyz, at, _: mapped.__setitem__(slice(at, at + len(xyz)), xyz)
        mapped.flush()
        del mapped
    elif fmt == "ply":
        kind = "double" if dtype == np.float64 else "float"
        with open(tmp, "wb") as fh:
            fh.write(
                f"ply\nformat binary_little_endian 1.0\ncomment written by pointforge\nelement vertex {total}\n"
                f"property {kind} x\nproperty {kind} y\nproperty {kind} z\nend_header\n".encode("ascii")
            )
            yield lambda xyz, at, _: fh.write(np.ascontiguousarray(xyz, dtype="<" + dtype.str[1:]).tobytes())
    else:
        import laspy

        assert las is not None
        header = las_header(las)
        scales, offsets = np.asarray(las.scales), np.asarray(las.offsets)
        with laspy.open(tmp, mode="w", header=header, do_compress=fmt == "laz") as writer:

            def append(xyz: np.ndarray, at: int, path: Path) -> None:
                ints = np.round((np.asarray(xyz, dtype=np.float64) - offsets) / scales)
                if len(ints) and (ints.min() < _INT32[0] or ints.max() > _INT32[1]):
                    raise DataError(
                        f"{path}: coordinates do not fit LAS 32-bit integers at scales {tuple(scales)} and offsets "
                        f"{tuple(offsets)}; use a coarser scale or offsets near the data"
                    )
                record = laspy.ScaleAwarePointRecord.zeros(len(ints), header=header)
                record.X, record.Y, record.Z = (ints[:, i].astype(np.int32) for i in range(3))
                writer.write_points(record)

            yield append

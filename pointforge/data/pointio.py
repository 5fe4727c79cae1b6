"""Read and write point clouds: ``.npy``, ``.ply`` (binary or ASCII), ``.las``/``.laz``.

Coordinates come back as float64 ``[N, 3]`` holding exactly the stored values,
and go out exactly again:

* ``.npy``: an ``[N, 3]`` (or ``[N, C >= 3]``: first three columns are x, y, z)
  numeric array, or a structured array with ``x``, ``y``, ``z`` fields. Written
  in the cloud's storage precision (float32 or float64).
* ``.ply``: our own reader/writer. trimesh always writes ``float`` (float32)
  coordinates, which silently rounds float64 clouds such as georeferenced lidar,
  so it does not round-trip. Reads ASCII, binary little- and big-endian, any
  numeric type for x/y/z, other properties and elements (faces, ...) skipped.
  Writes ``float`` or ``double`` by the cloud's precision; ASCII with enough
  digits (9 / 17) to restore every value.
* ``.las``/``.laz`` (laspy, lazrs): coordinates are integers times a per-axis
  scale plus an offset. Reading keeps scales, offsets, point format, version and
  the coordinate-reference VLRs in :class:`LasGeometry`; writing with that
  geometry restores the integers exactly. Other geometry quantises to its scale
  (the nature of LAS); coordinates that do not fit 32-bit integers are refused.

Every write goes to a temporary file in the target folder and is renamed into
place, so no half-written cloud ever has the final name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.errors import DataError

__all__ = [
    "POINT_SUFFIXES",
    "LasGeometry",
    "PointCloud",
    "point_format",
    "read_points",
    "count_points",
    "write_points",
    "atomic_write",
    "las_geometry",
    "las_header",
]

POINT_SUFFIXES = (".npy", ".ply", ".las", ".laz")

_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}  # fmt: skip
_PLY_FORMATS = {"ascii": None, "binary_little_endian": "<", "binary_big_endian": ">"}
_INT32 = (-(2**31), 2**31 - 1)
# Writing new points to LAS without a geometry: millimetres, offset at the data.
DEFAULT_LAS_SCALE = 0.001


@dataclass(frozen=True)
class LasGeometry:
    """What a LAS/LAZ file needs to store coordinates exactly: integers × scale + offset."""

    scales: tuple[float, ...]  # x, y, z
    offsets: tuple[float, ...]  # x, y, z
    point_format: int = 1
    version: str = "1.2"
    # Coordinate-reference records ("LASF_Projection" VLRs/EVLRs), carried to outputs.
    crs_vlrs: tuple = field(default=(), compare=False, repr=False)
    crs_evlrs: tuple = field(default=(), compare=False, repr=False)
    wkt: bool = False

    @classmethod
    def around(cls, xyz: np.ndarray, scale: float = DEFAULT_LAS_SCALE) -> "LasGeometry":
        """A geometry for new points: ``scale`` on every axis, offsets at the data's lower corner."""
        lo = np.floor(xyz.min(axis=0)) if len(xyz) else np.zeros(3)
        return cls(scales=(scale,) * 3, offsets=tuple(float(v) for v in lo))


@dataclass
class PointCloud:
    """``xyz`` float64 ``[N, 3]``; ``dtype`` the precision it was stored in; ``las`` for LAS sources."""

    xyz: np.ndarray
    dtype: np.dtype = np.dtype(np.float64)
    las: Optional[LasGeometry] = None

    def __len__(self) -> int:
        return int(self.xyz.shape[0])


def point_format(path: str | os.PathLike) -> str:
    """'npy', 'ply', 'las' or 'laz' from the file name; DataError for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix not in POINT_SUFFIXES:
        raise DataError(
            f"{path}: unsupported point cloud format {suffix or '(no suffix)'!r}; use one of {', '.join(POINT_SUFFIXES)}"
        )
    return suffix[1:]


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such point cloud file; check the path")
    return path


def _finite_xyz(xyz: np.ndarray, path: Path) -> np.ndarray:
    if not np.isfinite(xyz).all():
        raise DataError(f"{path}: point cloud has NaN or infinite coordinates; clean the file first")
    return xyz


def _storage_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if np.dtype(dtype) == np.float32 else np.dtype(np.float64)


# --------------------------------------------------------------------------- reading


def _is_format_error(err: Exception) -> bool:
    # laspy and its LAZ backend lazrs raise their own types for damaged files.
    return isinstance(err, (OSError, ValueError, EOFError, KeyError)) or type(err).__module__.split(".")[0] in (
        "laspy",
        "lazrs",
    )


def read_points(path: str | os.PathLike) -> PointCloud:
    """Read a point cloud (module docs); DataError naming the file on any problem."""
    fmt = point_format(path)
    path = _existing(path)
    try:
        if fmt == "npy":
            cloud = _read_npy(path)
        elif fmt == "ply":
            cloud = _read_ply(path)
        else:
            cloud = _read_las(path)
    except DataError:
        raise
    except Exception as err:
        if not _is_format_error(err):
            raise
        raise DataError(
            f"{path}: cannot read point cloud ({err}); is the file complete and a valid {fmt.upper()}?"
        ) from None
    _finite_xyz(cloud.xyz, path)
    return cloud


def count_points(path: str | os.PathLike) -> int:
    """Number of points, from the file's header only (cheap, for batch planning)."""
    fmt = point_format(path)
    path = _existing(path)
    try:
        if fmt == "npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            return int(array.shape[0]) if array.ndim >= 1 else 0
        if fmt == "ply":
            with open(path, "rb") as fh:
                header = _ply_header(fh, path)
            return header.elements[header.vertex_position][1]
        import laspy

        with laspy.open(path) as reader:
            return int(reader.header.point_count)
    except DataError:
        raise
    except Exception as err:
        if not _is_format_error(err):
            raise
        raise DataError(f"{path}: cannot read the point count ({err}); is the file a valid {fmt.upper()}?") from None


def _read_npy(path: Path) -> PointCloud:
    array = np.load(path, allow_pickle=False)
    if array.dtype.names:
        missing = [n for n in "xyz" if n not in array.dtype.names]
        if missing or array.ndim != 1:
            raise DataError(f"{path}: structured array needs 1-D x, y, z fields (missing {missing})")
        dtypes = {array.dtype[n] for n in "xyz"}
        xyz = np.stack([array[n] for n in "xyz"], axis=1)
    else:
        if array.ndim != 2 or array.shape[1] < 3:
            raise DataError(f"{path}: expected an [N, 3] array of coordinates, got shape {array.shape}")
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise DataError(f"{path}: coordinates must be numbers, got dtype {array.dtype}")
        dtypes = {array.dtype}
        xyz = array[:, :3]
    stored = _storage_dtype(dtypes.pop()) if len(dtypes) == 1 else np.dtype(np.float64)
    return PointCloud(xyz=np.ascontiguousarray(xyz, dtype=np.float64), dtype=stored)


@dataclass
class _PlyHeader:
    fmt: str
    elements: list  # [(name, count, [(prop name, numpy type | ('list', count type, item type))])]
    vertex_position: int
    data_start: int


def _ply_header(fh, path: Path) -> _PlyHeader:
    if fh.readline().strip() != b"ply":
        raise DataError(f"{path}: not a PLY file (no 'ply' magic line)")
    fmt = None
    elements: list = []
    while True:
        raw = fh.readline()
        if not raw:
            raise DataError(f"{path}: PLY header has no end_header line; the file is truncated or not PLY")
        words = raw.decode("ascii", errors="replace").split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "end_header":
            break
        if words[0] == "format":
            if len(words) < 2 or words[1] not in _PLY_FORMATS:
                raise DataError(f"{path}: unknown PLY format {' '.join(words[1:])!r}")
            fmt = words[1]
        elif words[0] == "element" and len(words) == 3:
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property" and elements:
            if words[1] == "list" and len(words) == 5:
                if words[2] not in _PLY_TYPES or words[3] not in _PLY_TYPES:
                    raise DataError(f"{path}: unknown PLY list type in {raw.decode(errors='replace').strip()!r}")
                elements[-1][2].append((words[4], ("list", _PLY_TYPES[words[2]], _PLY_TYPES[words[3]])))
            elif len(words) == 3 and words[1] in _PLY_TYPES:
                elements[-1][2].append((words[2], _PLY_TYPES[words[1]]))
            else:
                raise DataError(f"{path}: cannot parse PLY header line {raw.decode(errors='replace').strip()!r}")
        else:
            raise DataError(f"{path}: cannot parse PLY header line {raw.decode(errors='replace').strip()!r}")
    if fmt is None:
        raise DataError(f"{path}: PLY header has no format line")
    names = [e[0] for e in elements]
    if "vertex" not in names:
        raise DataError(f"{path}: PLY file has no vertex element")
    position = names.index("vertex")
    props = [p[0] for p in elements[position][2]]
    if not all(axis in props for axis in "xyz"):
        raise DataError(f"{path}: PLY vertices lack x, y or z properties (have {props})")
    return _PlyHeader(fmt=fmt, elements=elements, vertex_position=position, data_start=fh.tell())


def _skip_binary_element(fh, count: int, props: list, order: str) -> None:
    if all(not isinstance(t, tuple) for _, t in props):
        fh.seek(count * sum(np.dtype(t).itemsize for _, t in props), os.SEEK_CUR)
        return
    for _ in range(count):  # list properties: every row has its own length
        for _, t in props:
            if isinstance(t, tuple):
                n = int(np.frombuffer(fh.read(np.dtype(t[1]).itemsize), dtype=order + t[1])[0])
                fh.seek(n * np.dtype(t[2]).itemsize, os.SEEK_CUR)
            else:
                fh.seek(np.dtype(t).itemsize, os.SEEK_CUR)


def _read_ply(path: Path) -> PointCloud:
    with open(path, "rb") as fh:
        header = _ply_header(fh, path)
        name, count, props = header.elements[header.vertex_position]
        if any(isinstance(t, tuple) for _, t in props):
            raise DataError(
                f"{path}: PLY vertex element has list properties; only scalar vertex properties are supported"
            )
        types = {p: t for p, t in props}
        stored = _storage_dtype(types["x"]) if types["x"] == types["y"] == types["z"] else np.dtype(np.float64)
        if header.fmt == "ascii":
            skip_rows = sum(e[1] for e in header.elements[: header.vertex_position])
            for _ in range(skip_rows):
                fh.readline()
            rows = [fh.readline() for _ in range(count)]
            if count and not rows[-1]:
                raise DataError(f"{path}: PLY file ends before its {count} vertices; the file is truncated")
            try:
                table = np.array([r.split() for r in rows], dtype=np.float64).reshape(count, len(props))
            except ValueError:
                raise DataError(f"{path}: PLY vertex rows are not {len(props)} numbers each") from None
            column = {p: i for i, (p, _) in enumerate(props)}
            # Values become what a binary file of the declared types would hold.
            xyz = np.stack([table[:, column[a]].astype(types[a]).astype(np.float64) for a in "xyz"], axis=1)
        else:
            endian = cast(str, _PLY_FORMATS[header.fmt])  # only "ascii" maps to None
            for _, n, p in header.elements[: header.vertex_position]:
                _skip_binary_element(fh, n, p, endian)
            record = np.dtype([(p, endian + t) for p, t in props])
            payload = fh.read(record.itemsize * count)
            if len(payload) != record.itemsize * count:
                raise DataError(f"{path}: PLY file ends before its {count} vertices; the file is truncated")
            vertices = np.frombuffer(payload, dtype=record)
            xyz = np.stack([vertices[a].astype(np.float64) for a in "xyz"], axis=1)
    return PointCloud(xyz=np.ascontiguousarray(xyz), dtype=stored)


def _read_las(path: Path) -> PointCloud:
    import laspy

    las = laspy.read(path)
    header = las.header
    if len(las.points) != header.point_count:
        raise DataError(
            f"{path}: holds {len(las.points)} of the {header.point_count} points its header announces; the file is truncated"
        )
    geometry = las_geometry(header)
    ints = np.stack([np.asarray(las.X), np.asarray(las.Y), np.asarray(las.Z)], axis=1).astype(np.float64)
    xyz = ints * np.asarray(geometry.scales) + np.asarray(geometry.offsets)
    return PointCloud(xyz=xyz, dtype=np.dtype(np.float64), las=geometry)


def las_geometry(header: Any) -> LasGeometry:
    """The :class:`LasGeometry` of a laspy header: scales, offsets, point format, version, CRS records."""

    def projection(records: Any) -> tuple:
        return tuple(v for v in (records or []) if getattr(v, "user_id", "") == "LASF_Projection")

    return LasGeometry(
        scales=tuple(float(s) for s in header.scales),
        offsets=tuple(float(o) for o in header.offsets),
        point_format=int(header.point_format.id),
        version=str(header.version),
        crs_vlrs=projection(header.vlrs),
        crs_evlrs=projection(getattr(header, "evlrs", None)),
        wkt=bool(header.global_encoding.wkt),
    )


# --------------------------------------------------------------------------- writing


def atomic_write(path: Path, write) -> Path:
    """Call ``write(temporary path)`` then rename into place; never leaves a partial ``path``."""
    with atomic_path(path, suffix=Path(path).suffix) as tmp:
        write(str(tmp))
    return Path(path)


def write_points(
    path: str | os.PathLike,
    xyz: np.ndarray | PointCloud,
    *,
    dtype: Optional[np.dtype | type] = None,
    las: Optional[LasGeometry] = None,
    ply_ascii: bool = False,
) -> Path:
    """Write ``xyz [N, 3]`` (or a :class:`PointCloud`) atomically; the format follows the suffix.

    ``dtype`` (npy, ply): float32 or float64; default the cloud's precision
    (float64 for a bare array unless it is float32). ``las`` (las, laz): the
    geometry to store with, default the cloud's own, else
    :meth:`LasGeometry.around` the points. ``ply_ascii``: ASCII rather than
    binary little-endian PLY.
    """
    path = Path(path)
    fmt = point_format(path)
    if isinstance(xyz, PointCloud):
        cloud_dtype, las = xyz.dtype, las or xyz.las
        xyz = xyz.xyz
    else:
        xyz = np.asarray(xyz)
        cloud_dtype = _storage_dtype(xyz.dtype)
    if xyz.ndim != 2 or xyz.shape[1] != 3:
        raise DataError(f"{path}: points to write must be [N, 3], got shape {xyz.shape}")
    _finite_xyz(xyz, path)
    out_dtype = np.dtype(dtype) if dtype is not None else cloud_dtype
    if out_dtype not in (np.float32, np.float64):
        raise DataError(f"{path}: points are written as float32 or float64, not {out_dtype}")
    if fmt == "npy":
        data = np.ascontiguousarray(xyz, dtype=out_dtype)

        def write(tmp):
            with open(tmp, "wb") as fh:
                np.save(fh, data)

        return atomic_write(path, write)
    if fmt == "ply":
        return atomic_write(path, lambda tmp: _write_ply(tmp, np.asarray(xyz, dtype=out_dtype), ply_ascii))
    geometry = las or LasGeometry.around(np.asarray(xyz, dtype=np.float64))
    return atomic_write(
        path, lambda tmp: _write_las(tmp, np.asarray(xyz, dtype=np.float64), geometry, fmt == "laz", path)
    )


def _write_ply(tmp: str, xyz: np.ndarray, ascii_: bool) -> None:
    kind = "double" if xyz.dtype == np.float64 else "float"
    fmt = "ascii" if ascii_ else "binary_little_endian"
    header = (
        f"ply\nformat {fmt} 1.0\ncomment written by pointforge\nelement vertex {len(xyz)}\n"
        f"property {kind} x\nproperty {kind} y\nproperty {kind} z\nend_header\n"
    )
    with open(tmp, "wb") as fh:
        fh.write(header.encode("ascii"))
        if ascii_:
            # 17 significant digits name every float64 exactly, so a float32 value too survives
            # being read as float64 and cast back (fewer digits could round twice).
            np.savetxt(fh, xyz.astype(np.float64), fmt="%.17g")
        else:
            fh.write(np.ascontiguousarray(xyz, dtype="<" + xyz.dtype.str[1:]).tobytes())


def _write_las(tmp: str, xyz: np.ndarray, geometry: LasGeometry, compress: bool, path: Path) -> None:
    import laspy

    scales = np.asarray(geometry.scales, dtype=np.float64)
    offsets = np.asarray(geometry.offsets, dtype=np.float64)
    ints = np.round((xyz - offsets) / scales)
    if len(ints) and (ints.min() < _INT32[0] or ints.max() > _INT32[1]):
        raise DataError(
            f"{path}: coordinates do not fit LAS 32-bit integers at scales {tuple(scales)} and offsets "
            f"{tuple(offsets)}; use a coarser scale or offsets near the data"
        )
    las = laspy.LasData(las_header(geometry))
    las.X, las.Y, las.Z = (ints[:, i].astype(np.int32) for i in range(3))
    las.write(tmp, do_compress=compress)


def las_header(geometry: LasGeometry) -> Any:
    """A new laspy header carrying ``geometry`` (scales, offsets, point format, version, CRS records)."""
    import laspy

    header = laspy.LasHeader(point_format=geometry.point_format, version=geometry.version)
    header.scales = np.asarray(geometry.scales, dtype=np.float64)
    header.offsets = np.asarray(geometry.offsets, dtype=np.float64)
    header.vlrs.extend(geometry.crs_vlrs)
    if geometry.crs_evlrs:
        header.evlrs = list(geometry.crs_evlrs)
    if geometry.wkt:
        header.global_encoding.wkt = True
    return header

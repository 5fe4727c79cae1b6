"""The template head of the anatomical family: MNE-Python's fsaverage surfaces as radial tables.

MNE-Python's wheel ships two surfaces of ``fsaverage`` (FreeSurfer's average
of 40 MRIs, in MNI305 space; MNE is BSD-3 licensed): the inner surface of the
skull (``fsaverage-inner_skull-bem.fif``, 10,242 vertices) and the scalp
(``fsaverage-head.fif``). They are read with MNE's own reader, moved to the
grid's axis convention (:mod:`pointforge.data.synthetic.grid`: x to the
patient's left, y posterior, z superior; MNE's are right, anterior, superior)
and turned into radial functions about a centre inside the skull: for each
direction on a 1° latitude-longitude table (:data:`LAYERS`), the distances to
the inner skull, to a smoothed copy of it and to the scalp, found by casting
rays against the meshes. Above the skull base the inner skull is star-shaped
about that centre (every face looks away from it), so the table is exact there
(read bilinearly, within 0.1 mm of the mesh); below, where the middle and
posterior fossae fold under, a ray keeps its outermost crossing — that part is
cut away anyway.

The table is built once per process, in about a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy import sparse
from scipy.spatial import cKDTree

from pointforge.errors import DataError

INNER_SKULL_FILE = "fsaverage-inner_skull-bem.fif"
SCALP_FILE = "fsaverage-head.fif"

# What a template table holds, per direction (distances in mm from the centre).
LAYERS = (
    "inner skull",  # distance to the inner surface of the skull
    "smooth inner skull",  # the same surface smoothed over 1–2 cm: the outer table's base
    "smooth cosine",  # cosine between that surface's outward normal and the ray
    "scalp",  # distance to the scalp
)
# MNE's frame is RAS (x right, y anterior, z superior); the grid's is x left, y posterior, z superior.
_RAS_TO_GRID = np.array([-1.0, -1.0, 1.0])
_TABLE_STEP_DEG = 1.0
_SMOOTHING_ITERATIONS = 100  # neighbour-averaging passes on a mesh of 3 mm edges: a blur of about 1.5 cm
_CANDIDATES = 6  # triangles tried per ray: the nearest by direction; more where none is hit


@dataclass(frozen=True)
class Surface:
    """A closed triangle mesh in mm, grid axes: vertices (V, 3), triangles (T, 3), unit vertex normals (V, 3)."""

    vertices: np.ndarray
    triangles: np.ndarray
    normals: np.ndarray


@dataclass(frozen=True)
class HeadTemplate:
    """The template head seen from ``centre`` (mm, grid axes), direction by direction.

    ``table`` holds :data:`LAYERS` over a latitude-longitude grid of directions
    (rows: polar angle from +z, 0° to 180°; columns: azimuth from -180°,
    wrapping around), read bilinearly between nodes.
    """

    centre: np.ndarray
    table: np.ndarray  # (len(LAYERS), rows, columns) float32

    def __call__(self, u: np.ndarray) -> tuple[np.ndarray, ...]:
        """The :data:`LAYERS` along unit directions ``u`` (3, N), float32 like ``u``."""
        layers, rows, cols = self.table.shape
        f32 = np.float32
        polar = np.arccos(np.clip(u[2], f32(-1.0), f32(1.0))) * f32((rows - 1) / np.pi)
        azimuth = (np.arctan2(u[1], u[0]) + f32(np.pi)) * f32(cols / (2.0 * np.pi))
        row = np.minimum(polar.astype(np.int32), rows - 2)
        col = np.minimum(azimuth.astype(np.int32), cols - 1)
        polar -= row
        azimuth -= col
        node = row * cols + col
        right = np.where(col == cols - 1, node + 1 - cols, node + 1)
        below, below_right = node + cols, right + cols
        return tuple(
            _lerp(_lerp(layer[node], layer[right], azimuth), _lerp(layer[below], layer[below_right], azimuth), polar)
            for layer in self.table.reshape(layers, -1)
        )


def fsaverage_folder() -> Path:
    try:
        import mne
    except ImportError as err:  # pragma: no cover - mne is a dependency
        raise DataError("the anatomical skull family needs MNE-Python: pip install mne") from err
    return Path(mne.__file__).parent / "data" / "fsaverage"


def read_surface(name: str) -> Surface:
    """One of the fsaverage BEM surfaces shipped with MNE, in mm and grid axes."""
    import mne

    path = fsaverage_folder() / name
    if not path.is_file():
        raise DataError(f"{path}: not found; reinstall MNE-Python (pip install --force-reinstall mne)")
    try:
        (surface,) = mne.read_bem_surfaces(path, verbose=False)
    except Exception as err:  # noqa: BLE001 - whatever MNE's reader finds wrong with its own file
        raise DataError(f"{path}: MNE cannot read it ({err}); reinstall MNE-Python") from err
    # Flipping two axes is a rotation: triangle orientation and outward normals survive it.
    return Surface(
        vertices=surface["rr"] * 1000.0 * _RAS_TO_GRID,
        triangles=np.asarray(surface["tris"]),
        normals=surface["nn"] * _RAS_TO_GRID,
    )


@lru_cache(maxsize=1)
def load_template() -> HeadTemplate:
    """The fsaverage head as seen from the middle of the inner skull's bounding box."""
    inner, scalp = read_surface(INNER_SKULL_FILE), read_surface(SCALP_FILE)
    centre = (inner.vertices.min(axis=0) + inner.vertices.max(axis=0)) / 2.0
    directions = table_directions()
    rows, cols, _ = directions.shape
    rays = directions.reshape(-1, 3)
    (inner_distance, _), (smooth_distance, smooth_cosine) = cast_rays(
        [inner, smooth_radially(inner, centre, _SMOOTHING_ITERATIONS)], centre, rays
    )
    ((scalp_distance, _),) = cast_rays([scalp], centre, rays)
    table = np.stack([inner_distance, smooth_distance, smooth_cosine, scalp_distance]).reshape(4, rows, cols)
    return HeadTemplate(centre=centre, table=table.astype(np.float32))


def table_directions() -> np.ndarray:
    """The table's nodes as unit vectors, (rows, columns, 3)."""
    polar = np.deg2rad(np.arange(0.0, 180.0 + 1e-9, _TABLE_STEP_DEG))
    azimuth = np.deg2rad(np.arange(-180.0, 180.0 - 1e-9, _TABLE_STEP_DEG))
    p, a = np.meshgrid(polar, azimuth, indexing="ij")
    return np.stack([np.sin(p) * np.cos(a), np.sin(p) * np.sin(a), np.cos(p)], axis=-1)


def cast_rays(
    surfaces: Sequence[Surface], centre: np.ndarray, directions: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Outermost crossing of each ray from ``centre`` with each surface: (distance, normal-to-ray cosine).

    The surfaces share their triangles and the directions of their vertices
    from ``centre`` (one mesh and its radial smoothings), so one search for
    candidate triangles serves them all.
    """
    tri = surfaces[0].triangles
    offsets = [s.vertices - centre for s in surfaces]
    centroid = offsets[0][tri].mean(axis=1)
    tree = cKDTree(centroid / np.linalg.norm(centroid, axis=1, keepdims=True))
    found = [(np.full(len(directions), np.nan), np.full(len(directions), np.nan)) for _ in surfaces]
    todo = np.arange(len(directions))
    for k in (_CANDIDATES, 8 * _CANDIDATES, len(tri)):
        if todo.size == 0:
            break
        _, nearest = tree.query(directions[todo], k=min(k, len(tri)))
        missed = np.zeros(len(todo), dtype=bool)
        for surface, v, (radius, cosine) in zip(surfaces, offsets, found):
            r, c = _crossings(surface, v, nearest, directions[todo])
            radius[todo], cosine[todo] = r, c
            missed |= np.isnan(r)
        todo = todo[missed]
    if todo.size:
        raise DataError(f"{len(todo)} rays from the template's centre miss its surface; is the MNE file intact?")
    return found


def smooth_radially(surface: Surface, centre: np.ndarray, iterations: int) -> Surface:
    """The surface with each vertex's distance from ``centre`` averaged with its neighbours', ``iterations`` times.

    Vertices move only along their rays, so the result shares the surface's
    triangles and vertex directions (see :func:`cast_rays`).
    """
    tri = surface.triangles
    n = len(surface.vertices)
    edges = np.concatenate([tri[:, [0, 1]], tri[:, [1, 2]], tri[:, [2, 0]]])
    adjacency = sparse.coo_matrix((np.ones(2 * len(edges)), (edges.ravel(), edges[:, ::-1].ravel())), shape=(n, n))
    adjacency = sparse.csr_matrix(adjacency)
    adjacency.data[:] = 1.0  # each edge once, whichever triangles share it
    mean_of_neighbours = sparse.diags(1.0 / np.asarray(adjacency.sum(axis=1)).ravel()) @ adjacency
    offset = surface.vertices - centre
    radius = np.linalg.norm(offset, axis=1)
    direction = offset / radius[:, None]
    for _ in range(iterations):
        radius = 0.5 * radius + 0.5 * (mean_of_neighbours @ radius)
    vertices = centre + direction * radius[:, None]
    return Surface(vertices=vertices, triangles=tri, normals=_vertex_normals(vertices, tri))


def _vertex_normals(vertices: np.ndarray, triangles: np.ndarray) -> np.ndarray:
    """Area-weighted means of the adjacent faces' outward normals."""
    a, b, c = (vertices[triangles[:, i]] for i in range(3))
    face = np.cross(b - a, c - a)  # length twice the area: the weight
    normals = np.zeros_like(vertices)
    for i in range(3):
        np.add.at(normals, triangles[:, i], face)
    return normals / np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-12)


def _crossings(surface: Surface, v: np.ndarray, candidates: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Möller–Trumbore from the origin for each ray against its candidate triangles; NaN where none is hit."""
    corners = surface.triangles[candidates]  # (N, k, 3)
    a, b, d = (np.moveaxis(v[corners[..., i]], -1, 0) for i in range(3))  # each (3, N, k)
    e1, e2, ray = b - a, d - a, u.T[:, :, None]
    p = _cross(ray, e2)
    det = _dot(e1, p)
    inv = 1.0 / np.where(np.abs(det) < 1e-12, np.nan, det)
    s = -_dot(a, p) * inv
    q = -_cross(a, e1)
    w = _dot(ray, q) * inv
    t = _dot(e2, q) * inv
    eps = 1e-9
    hit = (s >= -eps) & (w >= -eps) & (s + w <= 1.0 + eps) & (t > 0.0)
    t = np.where(hit, t, -np.inf)
    best = np.argmax(t, axis=1)
    rows = np.arange(len(u))
    distance = t[rows, best]
    s_best, w_best = s[rows, best], w[rows, best]
    n = surface.normals[corners[rows, best]]  # (N, 3, 3)
    normal = (1.0 - s_best - w_best)[:, None] * n[:, 0] + s_best[:, None] * n[:, 1] + w_best[:, None] * n[:, 2]
    normal /= np.maximum(np.linalg.norm(normal, axis=1, keepdims=True), 1e-12)
    cos = np.clip(np.sum(normal * u, axis=1), 1e-3, 1.0)
    missed = ~np.isfinite(distance)
    return np.where(missed, np.nan, distance), np.where(missed, np.nan, cos)


def _cross(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.stack([x[1] * y[2] - x[2] * y[1], x[2] * y[0] - x[0] * y[2], x[0] * y[1] - x[1] * y[0]])


def _dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return x[0] * y[0] + x[1] * y[1] + x[2] * y[2]


def _lerp(x: np.ndarray, y: np.ndarray, fraction: np.ndarray) -> np.ndarray:
    y -= x
    y *= fraction
    y += x
    return y

"""Synthetic SkullBreak- and SkullFix-style skulls with cranial defects.

The real datasets cannot be downloaded everywhere, so tests, the demo and the
benchmarks run on skulls made here. They are meant to be plausible, not
anatomical: a closed cranial vault with the proportions of an adult head, an open
skull base, brow and orbital notches at the front, and smooth skull-to-skull
variation; defects follow the five SkullBreak classes.

Axis convention (the same as SkullBreak's NRRDs, space ``left-posterior-superior``
with an identity direction matrix): a growing index along

* axis 0 moves towards the patient's **left** (index 0 is the right side),
* axis 1 moves **posterior** (index 0 is the face: the forehead, brow and orbits
  are at the low end of axis 1),
* axis 2 moves **superior** (index 0 is below the skull base; the vertex is at
  the high end).

Physical size, with a random ±8 % scaling per axis: about 145 mm wide (axis 0),
180 mm long (axis 1) and 130 mm from the vertex down to the base cut (axis 2;
about 140 mm to the lowest point of the rim, where the occiput curves under).
The vault is a superellipsoid-like shell, boxier in the coronal plane, narrower
at the forehead, with a rounded occiput, brow ridges and temporal hollows, plus
a random smooth radial perturbation (spherical harmonics up to l = 3). The bone
is 5–8 mm thick along the surface normal (drawn per skull, varying smoothly by
±12 %, thinner over the temples, thicker at the occiput and brow). The base is
open: the shell is cut off below a wavy cone through the vault centre, lower at
the back than at the front, and two orbital notches open into it below the
brow.

A SkullBreak-style grid is S³ with isotropic spacing 230/S mm (a 230 mm field
of view). A SkullFix-style grid is S×S×Z with Z ≈ 0.55–0.68·S, in-plane spacing
230/S mm (0.45 mm at S = 512, like SkullFix) and slices 1.25× thicker. The head
is centred in the field of view, up to a random shift of at most 4 mm and a tilt
of at most 3° about each axis. Voxel (0, 0, 0) sits at
``origin = -spacing·(shape-1)/2``, so physical (0, 0, 0) is the grid's centre.

At small sizes the bone is thickened to at least two voxels so the shell stays
watertight: its only openings are the skull base (with the orbital notches) and
the defects. The few voxel configurations where 6- and 26-connectivity would
disagree (bone touching only along an edge or at a corner) are filled, so a
complete skull is one piece with Euler number 1 under either connectivity (a
thickened disc: no tunnels, no cavities) and marching cubes sees no pinholes.

Defect regions are cones from the centre of the vault, so every defect cuts
through the full thickness of the bone; their outlines are ellipses in the
tangent plane with wavy edges, sized in mm on the surface:

* ``bilateral``: a mirrored pair over the left and right parietal bones,
  each about 5.6–7.2 cm by 4.4–6 cm, with bone left along the midline;
* ``frontoorbital``: the forehead down into the brow and the orbital notches,
  about 6.8–8.8 cm by 6–7.6 cm;
* ``parietotemporal``: one side (left or right at random), about 9–11.6 cm by
  7.2–9.2 cm;
* ``random_1``, ``random_2``: a union of 3–5 overlapping irregular patches
  anywhere on the upper vault, about 4–8 cm overall;
* ``vault`` (SkullFix layout): one rounded defect of about 5–8.4 cm high on
  the vault.

Where a defect reaches the base opening or an orbit, the cut stops there.

Components are
counted with 26-connectivity: every defect region yields exactly one connected
implant piece (``bilateral`` is two regions, one per side, mirrored), and the
defective skull stays one connected piece (bone a cut would leave floating is
moved into the implant).

Seeds: skull ``k`` of ``synthesize(seed=s)`` is the same for any number of
skulls, and each defect class has its own random stream, so outputs are
reproducible piece by piece.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from scipy import ndimage

from pointforge.data.surface import bounding_box, make_well_composed as _make_well_composed
from pointforge.data.volumes import write_volume
from pointforge.errors import ConfigError, DataError

DEFECT_CLASSES = ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2")
SKULLFIX_DEFECT = "vault"
LAYOUTS = ("skullbreak", "skullfix")
MIN_SIZE, MAX_SIZE = 64, 512

FOV_MM = 230.0
SKULLFIX_SLICE_FACTOR = 1.25
SKULLFIX_DEPTH_RANGE = (0.55, 0.68)

# Bone narrower than this many voxels leaves 26-connected gaps between the
# inside and the outside of the vault.
_MIN_THICKNESS_VOXELS = 2.0
_BLOCK = 8
_CHUNK_POINTS = 1 << 21

_STRUCT26 = np.ones((3, 3, 3), dtype=bool)


# --------------------------------------------------------------------------- validation


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ConfigError(f"size must be an integer from {MIN_SIZE} to {MAX_SIZE}, got {size!r}")
    if not MIN_SIZE <= int(size) <= MAX_SIZE:
        raise ConfigError(f"size must be from {MIN_SIZE} to {MAX_SIZE} voxels, got {size}")
    return int(size)


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    return layout


# --------------------------------------------------------------------------- smooth random fields on the sphere


def _fibonacci_sphere(n: int) -> np.ndarray:
    i = np.arange(n) + 0.5
    z = 1.0 - 2.0 * i / n
    phi = np.pi * (1.0 + 5**0.5) * i
    s = np.sqrt(1.0 - z * z)
    return np.stack([s * np.cos(phi), s * np.sin(phi), z])


_FIELD_DEGREE = 3


@dataclass(frozen=True)
class _SphereField:
    """A random smooth function on the unit sphere with zero mean.

    A polynomial of degree ≤ 3 in the direction's coordinates: on the sphere these
    span the spherical harmonics up to l = 3, i.e. a few broad bumps and dents.
    ``coeffs[a, b, c]`` multiplies x^a y^b z^c.
    """

    coeffs: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, amplitude: float) -> "_SphereField":
        n = _FIELD_DEGREE + 1
        raw = np.zeros((n, n, n))
        for a in range(n):
            for b in range(n - a):
                for c in range(1 if a + b == 0 else 0, n - a - b):
                    # Higher orders weaker, so the field stays smooth.
                    raw[a, b, c] = rng.normal() / (1.0 + a + b + c)
        probe = _eval_poly(_fibonacci_sphere(600), raw)
        scale = amplitude / max(float(probe.std()), 1e-12)
        coeffs = raw * scale
        coeffs[0, 0, 0] -= probe.mean() * scale
        return cls(coeffs=coeffs)

    def __call__(self, u: np.ndarray) -> np.ndarray:
        return _eval_poly(u, self.coeffs)


def _eval_poly(u: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """Nested Horner evaluation: one multiply-add per coefficient, the hot loop of skull making."""
    x, y, z = u
    n = coeffs.shape[0]
    out = None
    for a in reversed(range(n)):
        g = None
        for b in reversed(range(n - a)):
            h = None
            for c in reversed(range(n - a - b)):
                k = coeffs[a, b, c].astype(x.dtype)
                h = np.full_like(z, k) if h is None else _mul_add(h, z, k)
            g = h if g is None else _mul_add(g, y, h)
        out = g if out is None else _mul_add(out, x, g)
    return out


def _mul_add(acc: np.ndarray, factor: np.ndarray, term) -> np.ndarray:
    acc *= factor
    acc += term
    return acc


def _bump(u: np.ndarray, centre, width: float) -> np.ndarray:
    """A smooth bump on the sphere around ``centre``, 1 at its centre, ``width`` in chord length."""
    c = np.asarray(centre, dtype=np.float64)
    c = (c / np.linalg.norm(c)).astype(np.float32)
    chord2 = 2.0 - 2.0 * (c[0] * u[0] + c[1] * u[1] + c[2] * u[2])
    return np.exp(chord2 * np.float32(-1.0 / (width * width)))


# --------------------------------------------------------------------------- skull geometry


@dataclass(frozen=True)
class _SkullParams:
    half_width: float
    half_length_front: float
    half_length_back: float
    height_up: float
    depth_front: float
    depth_side: float
    depth_back: float
    coronal_power: float
    sagittal_power: float
    shape_noise: _SphereField
    thickness_mm: float
    thickness_noise: _SphereField
    min_thickness_mm: float
    base_drop_deg: tuple[float, float, float]  # how far below the horizon the cut runs: front, sides, back
    base_wave: tuple[tuple[int, float, float], ...]  # (harmonic, amplitude in degrees, phase) around the head
    orbit_direction: np.ndarray  # the right orbit; the left one is its mirror image
    orbit_half_width: float  # tangent of the angular half-width seen from the vault centre
    orbit_half_height: float
    rotation: np.ndarray | None = None  # head frame -> grid frame
    centre_mm: np.ndarray | None = None  # head-frame origin in grid physical coordinates


def _draw_params(rng: np.random.Generator, spacing: np.ndarray, extent_mm: np.ndarray) -> _SkullParams:
    sx, sy, sz = 1.0 + rng.uniform(-0.08, 0.08, size=3)
    orbit_centre = np.array([32.0 * sx + rng.uniform(-2.0, 2.0), -86.0 * sy, -30.0 * sz + rng.uniform(-2.0, 2.0)])
    orbit_distance = float(np.linalg.norm(orbit_centre))
    params = _SkullParams(
        half_width=72.5 * sx,
        half_length_front=86.0 * sy,
        half_length_back=94.0 * sy,
        height_up=90.0 * sz,
        depth_front=105.0 * sz,
        depth_side=88.0 * sz,
        depth_back=62.0 * sz,
        coronal_power=rng.uniform(2.3, 2.7),
        sagittal_power=rng.uniform(2.0, 2.3),
        shape_noise=_SphereField.draw(rng, rng.uniform(0.015, 0.03)),
        thickness_mm=rng.uniform(5.0, 8.0),
        thickness_noise=_SphereField.draw(rng, 0.12),
        min_thickness_mm=_MIN_THICKNESS_VOXELS * float(spacing.max()),
        base_drop_deg=(24.0 + rng.uniform(-2, 2), 28.0 + rng.uniform(-2, 2), 31.0 + rng.uniform(-2, 2)),
        base_wave=tuple((k, float(rng.uniform(0.5, 2.0)), float(rng.uniform(0, 2 * np.pi))) for k in (2, 3, 5)),
        orbit_direction=orbit_centre / orbit_distance,
        orbit_half_width=rng.uniform(18.0, 21.0) / orbit_distance,
        orbit_half_height=rng.uniform(16.0, 19.0) / orbit_distance,
    )
    rotation = _rotation(*np.deg2rad(rng.uniform(-3.0, 3.0, size=3)))
    # The bounding box of the outer surface, sampled densely over directions, is
    # centred in the field of view (up to a small random shift).
    u = _fibonacci_sphere(20000).astype(np.float32)
    keep = _above_base(params, u) & ~_in_orbit(params, u)
    surface = rotation @ (u * _outer_radius(params, u))[:, keep]
    box_lo, box_hi = surface.min(axis=1), surface.max(axis=1)
    if np.any(box_hi - box_lo > extent_mm - 8.0):
        raise ConfigError(
            f"field of view {np.round(extent_mm, 1).tolist()} mm is too small for a "
            f"{np.round(box_hi - box_lo, 1).tolist()} mm head; use a larger shape or spacing"
        )
    slack = (extent_mm - (box_hi - box_lo)) / 2.0
    shift = rng.uniform(-1.0, 1.0, size=3) * np.minimum(4.0, np.maximum(slack - 4.0, 0.0))
    return replace(params, rotation=rotation, centre_mm=-(box_lo + box_hi) / 2.0 + shift)


def _rotation(a: float, b: float, c: float) -> np.ndarray:
    ca, sa, cb, sb, cc, sc = np.cos(a), np.sin(a), np.cos(b), np.sin(b), np.cos(c), np.sin(c)
    rx = np.array([[1, 0, 0], [0, ca, -sa], [0, sa, ca]])
    ry = np.array([[cb, 0, sb], [0, 1, 0], [-sb, 0, cb]])
    rz = np.array([[cc, -sc, 0], [sc, cc, 0], [0, 0, 1]])
    return rz @ ry @ rx


def _outer_radius(p: _SkullParams, u: np.ndarray) -> np.ndarray:
    ux, uy, uz = np.abs(u[0]), u[1], u[2]
    ay = np.where(uy < 0, np.float32(p.half_length_front), np.float32(p.half_length_back))
    # Below the centre the back of the vault curves under towards the foramen magnum,
    # the sides draw in a little towards the temples and the forehead stays steep.
    back, front = np.clip(uy, 0.0, 1.0), np.clip(-uy, 0.0, 1.0)
    depth = (
        np.float32(p.depth_side)
        + np.float32(p.depth_back - p.depth_side) * back * back
        + np.float32(p.depth_front - p.depth_side) * front * front
    )
    az = np.where(uz > 0, np.float32(p.height_up), depth)
    q1, q2 = np.float32(p.coronal_power), np.float32(p.sagittal_power)
    coronal = ((ux / np.float32(p.half_width)) ** q1 + (np.abs(uz) / az) ** q1) ** (q2 / q1)
    radius = (coronal + np.abs(uy / ay) ** q2) ** (-1.0 / q2)
    factor = (
        1.0
        + p.shape_noise(u)
        - 0.25 * (ux * ux) * front * front  # narrower forehead: the head is egg-shaped from above
        + 0.05 * _bump(u, (0.0, 1.0, -0.15), 0.45)  # occiput
        + 0.02 * _bump(u, (0.0, 0.85, -0.5), 0.15)  # external occipital protuberance
        + 0.025 * (_bump(u, (0.3, -0.95, 0.0), 0.2) + _bump(u, (-0.3, -0.95, 0.0), 0.2))  # brow ridges
        - 0.035 * (_bump(u, (0.8, -0.5, -0.3), 0.3) + _bump(u, (-0.8, -0.5, -0.3), 0.3))  # temporal fossae
    )
    return radius * factor


def _thickness(p: _SkullParams, u: np.ndarray) -> np.ndarray:
    temporal = _bump(u, (0.95, -0.05, -0.3), 0.45) + _bump(u, (-0.95, -0.05, -0.3), 0.45)
    t = np.float32(p.thickness_mm) * (
        1.0
        + p.thickness_noise(u)
        - 0.35 * temporal
        + 0.3 * _bump(u, (0.0, 0.95, -0.35), 0.35)
        + 0.2 * (_bump(u, (0.3, -0.95, 0.0), 0.2) + _bump(u, (-0.3, -0.95, 0.0), 0.2))
    )
    return np.maximum(t, np.float32(p.min_thickness_mm))


def _obliquity(p: _SkullParams, u: np.ndarray, outer: np.ndarray) -> np.ndarray:
    """1/cos of the angle between the surface normal and the radial direction.

    Thickness is meant along the normal; measured along the ray it is this much
    longer. Where the vault curves under (occiput, brow) ignoring it would thin
    the bone below two voxels and open gaps through the shell.
    """
    # Tangent directions: u × (1, 0, 0), or u × (0, 1, 0) where u is nearly along x.
    along_x = np.abs(u[0]) >= 0.9
    zero = np.zeros_like(u[0])
    e1 = np.stack([np.where(along_x, -u[2], zero), np.where(along_x, zero, u[2]), np.where(along_x, u[0], -u[1])])
    e1 /= np.sqrt(np.sum(e1 * e1, axis=0))
    e2 = np.stack([u[1] * e1[2] - u[2] * e1[1], u[2] * e1[0] - u[0] * e1[2], u[0] * e1[1] - u[1] * e1[0]])
    eps = np.float32(2e-3)
    slope2 = np.zeros_like(outer)
    for e in (e1, e2):
        v = u + eps * e
        v /= np.sqrt(np.sum(v * v, axis=0))
        slope2 += ((_outer_radius(p, v) - outer) / (eps * outer)) ** 2
    return np.sqrt(1.0 + slope2)


# The base cut and the orbits are bounded by surfaces through the vault centre, so
# they cross the bone square-on: a cut that grazed the thin shell would leave
# slivers and pinholes along the rim.


def _above_base(p: _SkullParams, u: np.ndarray) -> np.ndarray:
    horizontal = np.maximum(np.sqrt(u[0] ** 2 + u[1] ** 2), np.float32(1e-6))
    hy = u[1] / horizontal
    azimuth = np.arctan2(u[1], u[0])
    front_deg, side_deg, back_deg = p.base_drop_deg
    drop = (
        np.float32(side_deg)
        + np.float32(back_deg - side_deg) * np.clip(hy, 0.0, 1.0) ** 2
        + np.float32(front_deg - side_deg) * np.clip(-hy, 0.0, 1.0) ** 2
    )
    for k, amplitude, phase in p.base_wave:
        drop += np.float32(amplitude) * np.cos(np.float32(k) * azimuth + np.float32(phase))
    return u[2] >= -np.sin(np.deg2rad(drop))


def _in_orbit(p: _SkullParams, u: np.ndarray) -> np.ndarray:
    mirrored = np.stack([np.abs(u[0]), u[1], u[2]])
    d = p.orbit_direction
    e1 = _unit(np.cross([0.0, 0.0, 1.0], d))
    e2 = np.cross(d, e1)
    depth = np.tensordot(d.astype(np.float32), mirrored, axes=1)
    # Gnomonic coordinates: lines of constant s1 are great circles, so the sides of
    # the notch are planes through the centre.
    s1 = np.tensordot(e1.astype(np.float32), mirrored, axes=1) / np.maximum(depth, np.float32(1e-3))
    s2 = np.tensordot(e2.astype(np.float32), mirrored, axes=1) / np.maximum(depth, np.float32(1e-3))
    # Below its centre the orbit runs straight down into the base opening: a notch,
    # never a ring of bone that would make the shell a torus.
    up = np.maximum(s2, np.float32(0.0))
    return (depth > 0.5) & (
        (s1 / np.float32(p.orbit_half_width)) ** 2 + (up / np.float32(p.orbit_half_height)) ** 2 <= 1.0
    )


def _shell_terms(p: _SkullParams, pts: np.ndarray):
    """Head-frame points -> (radius, outer radius, inner radius, direction)."""
    r = np.sqrt(np.sum(pts * pts, axis=0))
    u = pts / np.maximum(r, np.float32(1e-6))
    outer = _outer_radius(p, u)
    return r, outer, outer - _thickness(p, u) * _obliquity(p, u, outer), u


def _bone(p: _SkullParams, pts: np.ndarray) -> np.ndarray:
    r, outer, inner, u = _shell_terms(p, pts)
    return (r <= outer) & (r >= inner) & _above_base(p, u) & ~_in_orbit(p, u)


def _to_head(p: _SkullParams, grid_mm: np.ndarray) -> np.ndarray:
    """Grid physical coordinates (3, N) -> head frame (3, N), float32."""
    shifted = grid_mm - p.centre_mm.astype(np.float32)[:, None]
    return p.rotation.T.astype(np.float32) @ shifted


def _grid_geometry(size: int, shape, spacing) -> tuple[tuple[int, int, int], np.ndarray]:
    if shape is None:
        shape = (size, size, size)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 16 or max(shape) > 1024:
        raise ConfigError(f"shape must be 3 sizes from 16 to 1024 voxels, got {shape}")
    if spacing is None:
        inplane = (FOV_MM / shape[0], FOV_MM / shape[1])
        cube = shape[2] == shape[0]
        spacing = (*inplane, FOV_MM / shape[2] if cube else inplane[0] * SKULLFIX_SLICE_FACTOR)
    spacing = np.asarray(spacing, dtype=np.float64)
    if spacing.shape != (3,) or not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
        raise ConfigError(f"spacing must be 3 positive numbers (mm), got {spacing.tolist()}")
    return shape, spacing


def _grid_origin(shape, spacing: np.ndarray) -> np.ndarray:
    return -spacing * (np.asarray(shape, dtype=np.float64) - 1.0) / 2.0


def make_skull(
    size: int,
    rng: np.random.Generator,
    *,
    shape: tuple[int, int, int] | None = None,
    spacing: tuple[float, float, float] | None = None,
) -> tuple[np.ndarray, tuple[float, float, float]]:
    """A complete synthetic skull: ``(bool volume, spacing in mm)``.

    The grid is ``shape`` (default ``(size,)*3``) with a 230 mm field of view
    along axes 0 and 1; axis 2 has it too on a cube, and otherwise (SkullFix-style
    ``S×S×Z``) slices 1.25× thicker than the in-plane spacing. ``spacing`` (mm)
    overrides that. Draws from ``rng`` only, so the same generator state gives the
    same skull. The geometry and axis convention are in the module docstring.
    """
    size = _check_size(size)
    shape, spacing = _grid_geometry(size, shape, spacing)
    extent = spacing * np.asarray(shape)
    params = _draw_params(rng, spacing, extent)
    return _rasterize(params, shape, spacing), tuple(float(s) for s in spacing)


def _rasterize(params: _SkullParams, shape, spacing: np.ndarray, *, block: int = _BLOCK) -> np.ndarray:
    """Evaluate the bone only in 8³ blocks that can touch the shell (a seventh of the grid at 512³)."""
    origin = _grid_origin(shape, spacing)
    nblocks = [-(-s // block) for s in shape]
    padded = np.zeros([n * block for n in nblocks], dtype=bool)
    bi = np.stack(np.meshgrid(*[np.arange(n) for n in nblocks], indexing="ij"), axis=-1).reshape(-1, 3)
    centres = (origin + (bi * block + (block - 1) / 2.0) * spacing).T.astype(np.float32)
    r, outer, inner, _ = _shell_terms(params, _to_head(params, centres))
    half_diag = 0.5 * block * float(np.linalg.norm(spacing))
    # Radial distance overstates the true distance where the surface is oblique;
    # a factor 2 covers obliquity up to 60°, beyond anything the shapes reach.
    reach = 2.0 * half_diag + float(spacing.max())
    near = (r <= outer + reach) & (r >= inner - reach)
    chosen = bi[near]
    offsets = np.stack(np.meshgrid(*[np.arange(block)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    view = padded.reshape(nblocks[0], block, nblocks[1], block, nblocks[2], block).transpose(0, 2, 4, 1, 3, 5)
    per_chunk = max(1, _CHUNK_POINTS // len(offsets))
    for start in range(0, len(chosen), per_chunk):
        blocks = chosen[start : start + per_chunk]
        grid_mm = np.stack(
            [
                (origin[a] + (blocks[:, a, None] * block + offsets[None, :, a]) * spacing[a]).astype(np.float32).ravel()
                for a in range(3)
            ]
        )
        bone = _bone(params, _to_head(params, grid_mm)).reshape(len(blocks), block, block, block)
        view[blocks[:, 0], blocks[:, 1], blocks[:, 2]] = bone
    return _finish(np.ascontiguousarray(padded[: shape[0], : shape[1], : shape[2]]))


def _finish(skull: np.ndarray) -> np.ndarray:
    skull = _make_well_composed(skull)
    labels, n = ndimage.label(skull)
    if n > 1:
        # Specks cut off at the rim are not bone a CT segmentation would keep.
        sizes = np.bincount(labels.ravel())
        sizes[0] = 0
        skull = labels == int(np.argmax(sizes))
    return skull


def _rasterize_dense(params: _SkullParams, shape, spacing: np.ndarray) -> np.ndarray:
    """Reference for :func:`_rasterize` (every voxel evaluated); tests compare the two."""
    origin = _grid_origin(shape, spacing)
    axes = np.meshgrid(*[origin[a] + np.arange(shape[a]) * spacing[a] for a in range(3)], indexing="ij")
    grid_mm = np.stack([g.ravel() for g in axes]).astype(np.float32)
    return _finish(_bone(params, _to_head(params, grid_mm)).reshape(shape))


# --------------------------------------------------------------------------- defects


@dataclass(frozen=True)
class _Patch:
    """An angular region seen from the vault centre: an ellipse in the tangent plane with a wavy edge."""

    direction: np.ndarray
    semi_axes_mm: tuple[float, float]
    angle: float
    wave: tuple[tuple[int, float, float], ...]  # (harmonic, amplitude, phase)


@dataclass(frozen=True)
class _SkullFrame:
    """Where a complete skull sits, estimated from its voxels alone (works on real skulls too)."""

    centre: np.ndarray  # mm, in index-scaled coordinates (index * spacing)
    index: np.ndarray  # (N, 3) bone voxels
    distance: np.ndarray  # (N,) mm from the centre
    direction: np.ndarray  # (N, 3) unit vectors from the centre

    @classmethod
    def of(cls, complete: np.ndarray, spacing: np.ndarray) -> "_SkullFrame":
        box = bounding_box(complete)
        lo_mm = np.array([s.start for s in box]) * spacing
        hi_mm = np.array([s.stop - 1 for s in box]) * spacing
        length = hi_mm[1] - lo_mm[1]
        # The vault's centre lies about half a head length below the vertex.
        centre = np.array([(lo_mm[0] + hi_mm[0]) / 2, (lo_mm[1] + hi_mm[1]) / 2, hi_mm[2] - 0.5 * length])
        centre[2] = max(centre[2], lo_mm[2])
        index = np.argwhere(complete)
        rel = (index * spacing - centre).astype(np.float32)
        distance = np.maximum(np.sqrt(np.sum(rel * rel, axis=1)), np.float32(1e-6))
        return cls(centre=centre, index=index, distance=distance, direction=rel / distance[:, None])

    def radius_along(self, direction: np.ndarray) -> float:
        """Distance from the centre to the outer bone surface around a direction (mm).

        Taken over a narrow cone rather than a single ray, which could pass
        through an orbit or the base opening.
        """
        cosines = self.direction @ direction.astype(np.float32)
        for half_angle in (10.0, 20.0, 35.0):
            near = cosines >= np.cos(np.deg2rad(half_angle))
            if near.sum() >= 8:
                return float(np.percentile(self.distance[near], 90))
        raise DataError(
            f"the complete skull has no bone around direction {np.round(direction, 2).tolist()} from its centre; "
            "is it oriented with axis 1 posterior and axis 2 superior?"
        )


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def _tangent_basis(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    helper = np.array([0.0, 0.0, 1.0]) if abs(d[2]) < 0.95 else np.array([1.0, 0.0, 0.0])
    e1 = _unit(np.cross(helper, d))
    return e1, np.cross(d, e1)


def _in_patch(patch: _Patch, radius_mm: float, u: np.ndarray) -> np.ndarray:
    d = patch.direction
    e1, e2 = _tangent_basis(d)
    f32 = np.float32
    cos_t = np.clip(u @ d.astype(f32), f32(-1.0), f32(1.0))
    t1, t2 = u @ e1.astype(f32), u @ e2.astype(f32)
    norm = np.maximum(np.sqrt(t1 * t1 + t2 * t2), f32(1e-9))
    arc = f32(radius_mm) * np.arccos(cos_t)
    c, s = f32(np.cos(patch.angle)), f32(np.sin(patch.angle))
    s1 = arc * (c * t1 + s * t2) / norm
    s2 = arc * (-s * t1 + c * t2) / norm
    phi = np.arctan2(s2, s1)
    edge = np.ones_like(phi)
    for k, amp, phase in patch.wave:
        edge += f32(amp) * np.cos(f32(k) * phi + f32(phase))
    a, b = f32(patch.semi_axes_mm[0]), f32(patch.semi_axes_mm[1])
    return (cos_t > 0.2) & ((s1 / a) ** 2 + (s2 / b) ** 2 <= edge * edge)


def _wave(rng: np.random.Generator, strength: float) -> tuple[tuple[int, float, float], ...]:
    return tuple(
        (k, float(rng.uniform(0.3, 1.0) * strength / k**0.5), float(rng.uniform(0, 2 * np.pi))) for k in range(2, 6)
    )


def _random_direction(rng: np.random.Generator, min_up: float) -> np.ndarray:
    while True:
        d = _unit(rng.normal(size=3))
        if d[2] >= min_up:
            return d


def _draw_patches(defect_class: str, rng: np.random.Generator, frame: _SkullFrame) -> list[list[tuple[_Patch, bool]]]:
    """Regions (each a union of patches; the flag mirrors a patch left↔right)."""
    if defect_class == "bilateral":
        d = _unit([0.62, rng.uniform(-0.1, 0.25), rng.uniform(0.65, 0.85)])
        patch = _Patch(d, (rng.uniform(28, 36), rng.uniform(22, 30)), rng.uniform(-0.5, 0.5), _wave(rng, 0.06))
        return [[(patch, False)], [(patch, True)]]
    if defect_class == "frontoorbital":
        d = _unit([rng.uniform(-0.2, 0.2), -1.0, rng.uniform(-0.12, 0.08)])
        patch = _Patch(d, (rng.uniform(34, 44), rng.uniform(30, 38)), rng.uniform(-0.3, 0.3), _wave(rng, 0.06))
        return [[(patch, False)]]
    if defect_class == "parietotemporal":
        side = 1.0 if rng.random() < 0.5 else -1.0
        d = _unit([side, rng.uniform(-0.2, 0.25), rng.uniform(0.1, 0.35)])
        patch = _Patch(d, (rng.uniform(45, 58), rng.uniform(36, 46)), rng.uniform(-0.4, 0.4), _wave(rng, 0.06))
        return [[(patch, False)]]
    if defect_class in ("random_1", "random_2"):
        d0 = _random_direction(rng, 0.15)
        first = _Patch(d0, (rng.uniform(20, 30), rng.uniform(16, 24)), rng.uniform(0, np.pi), _wave(rng, 0.2))
        patches = [(first, False)]
        radius = frame.radius_along(d0)
        e1, e2 = _tangent_basis(d0)
        for _ in range(int(rng.integers(2, 5))):
            # Centres inside the first patch (its wavy edge never comes closer than
            # 0.55 of its semi-axes) keep the union one piece.
            reach = 0.5 * min(first.semi_axes_mm) / radius
            ang = rng.uniform(0, 2 * np.pi)
            off = reach * np.sqrt(rng.uniform(0.3, 1.0))
            d = _unit(d0 + off * (np.cos(ang) * e1 + np.sin(ang) * e2))
            patches.append(
                (_Patch(d, (rng.uniform(14, 26), rng.uniform(10, 20)), rng.uniform(0, np.pi), _wave(rng, 0.2)), False)
            )
        return [patches]
    if defect_class == SKULLFIX_DEFECT:
        d = _random_direction(rng, 0.35)
        a = rng.uniform(25, 42)
        patch = _Patch(d, (a, a * rng.uniform(0.7, 1.0)), rng.uniform(0, np.pi), _wave(rng, 0.05))
        return [[(patch, False)]]
    raise ConfigError(
        f"unknown defect class {defect_class!r}; choose one of: {', '.join(DEFECT_CLASSES + (SKULLFIX_DEFECT,))}"
    )


def make_defect(
    complete: np.ndarray, defect_class: str, rng: np.random.Generator, spacing=(1.0, 1.0, 1.0)
) -> np.ndarray:
    """The bone a defect of ``defect_class`` removes (the implant), a subset of ``complete``.

    ``defective = complete & ~implant``. Works on any complete skull in the
    module's axis convention, real ones included; the vault centre and radii are
    measured from the voxels. ``"vault"`` (SkullFix-style) is accepted besides
    :data:`DEFECT_CLASSES`.
    """
    complete = np.asarray(complete)
    if complete.ndim != 3 or complete.dtype != bool:
        raise DataError(f"complete skull must be a 3-D bool volume, got {complete.dtype} of shape {complete.shape}")
    if not complete.any():
        raise DataError("complete skull is empty; cannot cut a defect from it")
    spacing = np.asarray(spacing, dtype=np.float64)
    if spacing.shape != (3,) or not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
        raise ConfigError(f"spacing must be 3 positive numbers (mm), got {spacing.tolist()}")
    # All the work happens inside the skull's bounding box: at 512³ that halves it.
    crop = bounding_box(complete, margin=1)
    full, complete = complete, complete[crop]
    frame = _SkullFrame.of(complete, spacing)
    regions = _draw_patches(defect_class, rng, frame)

    idx, u = frame.index, frame.direction
    mirrored_u = u * np.float32([-1.0, 1.0, 1.0])
    region_of = np.zeros(len(idx), dtype=np.int8)
    for number, patches in enumerate(regions, start=1):
        hit = np.zeros(len(idx), dtype=bool)
        for patch, mirror in patches:
            direction = patch.direction * (np.array([-1.0, 1.0, 1.0]) if mirror else 1.0)
            hit |= _in_patch(patch, frame.radius_along(direction), mirrored_u if mirror else u)
        region_of[hit & (region_of == 0)] = number
    region_map = np.zeros(complete.shape, dtype=np.int8)
    region_map[idx[:, 0], idx[:, 1], idx[:, 2]] = region_of
    implant = np.zeros_like(full)
    implant[crop] = _clean_implant(complete, region_map, len(regions), defect_class)
    return implant


def _clean_implant(complete: np.ndarray, region_map: np.ndarray, n_regions: int, defect_class: str) -> np.ndarray:
    implant = region_map > 0
    # Bone the cut leaves floating would fall out of a real defective skull: it belongs to the implant.
    labels, n = ndimage.label(complete & ~implant, structure=_STRUCT26)
    if n > 1:
        sizes = np.bincount(labels.ravel())
        sizes[0] = 0
        implant |= (labels != int(np.argmax(sizes))) & (labels > 0)
    # Slivers of the cut that touch their region only at an edge go back to the skull, so
    # that each region is one piece of implant.
    labels, n = ndimage.label(implant, structure=_STRUCT26)
    keep = np.zeros(n + 1, dtype=bool)
    sizes = np.bincount(labels.ravel(), minlength=n + 1)
    for number in range(1, n_regions + 1):
        in_region = np.unique(labels[region_map == number])
        in_region = in_region[in_region > 0]
        if in_region.size == 0:
            raise DataError(f"the {defect_class} defect missed the skull; is the skull oriented as documented?")
        keep[in_region[np.argmax(sizes[in_region])]] = True
    return keep[labels]


# --------------------------------------------------------------------------- writing datasets


def _skullfix_shape(size: int, rng: np.random.Generator) -> tuple[int, int, int]:
    return (size, size, int(round(size * rng.uniform(*SKULLFIX_DEPTH_RANGE))))


def synthesize(
    out_dir,
    n_skulls: int,
    size: int,
    seed: int,
    layout: str = "skullbreak",
    progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Write ``n_skulls`` synthetic cases in a SkullBreak or SkullFix folder layout.

    SkullBreak: ``complete_skull/NNN.nrrd``, ``defective_skull/<class>/NNN.nrrd``
    and ``implant/<class>/NNN.nrrd`` for each class in :data:`DEFECT_CLASSES`,
    S³ voxels. SkullFix: ``complete_skull/``, ``defective_skull/`` and
    ``implant/`` with one vault defect per skull, S×S×Z voxels. ``progress`` is
    called as ``progress(done, total, case_id)`` after each skull. Returns a
    summary: the cases with their shapes, spacings and voxel counts, and seconds.
    """
    layout = _check_layout(layout)
    size = _check_size(size)
    if isinstance(n_skulls, bool) or not isinstance(n_skulls, (int, np.integer)) or not 1 <= n_skulls <= 1000:
        raise ConfigError(f"number of skulls must be from 1 to 1000 (three-digit case ids), got {n_skulls!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
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
        shape = None if layout == "skullbreak" else _skullfix_shape(size, skull_rng)
        complete, spacing = make_skull(size, skull_rng, shape=shape)
        origin = tuple(float(o) for o in _grid_origin(complete.shape, np.asarray(spacing)))
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
        cases.append(
            {
                "id": case_id,
                "shape": [int(s) for s in complete.shape],
                "spacing": list(spacing),
                "origin": list(origin),
                "complete_voxels": int(complete.sum()),
                "defects": defects,
            }
        )
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

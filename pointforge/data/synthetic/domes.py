"""The dome family: plausible, not anatomical, skulls drawn as a shell in polar form.

A closed cranial vault with the proportions of an adult head, an open skull
base, brow and orbital notches at the front, and smooth skull-to-skull
variation. The head is centred in the field of view, up to a random shift of
at most 4 mm and a tilt of at most 3° about each axis (axes as in
:mod:`pointforge.data.synthetic.grid`).

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

At small sizes the bone is thickened to at least two voxels so the shell stays
watertight: its only openings are the skull base (with the orbital notches) and
the defects. The few voxel configurations where 6- and 26-connectivity would
disagree (bone touching only along an edge or at a corner) are filled, so a
complete skull is one piece with Euler number 1 under either connectivity (a
thickened disc: no tunnels, no cavities) and marching cubes sees no pinholes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from pointforge.data.synthetic.raster import skull_on_grid
from pointforge.data.synthetic.sphere import SphereField, bump, fibonacci_sphere, unit
from pointforge.errors import ConfigError

# Bone narrower than this many voxels leaves 26-connected gaps between the
# inside and the outside of the vault.
_MIN_THICKNESS_VOXELS = 2.0


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
    same skull. The geometry is in the module docstring.
    """
    return skull_on_grid(draw_params, size, rng, shape, spacing)


@dataclass(frozen=True)
class DomeParams:
    """One dome skull's shape and placement; a :class:`~pointforge.data.synthetic.raster.Shell`."""

    half_width: float
    half_length_front: float
    half_length_back: float
    height_up: float
    depth_front: float
    depth_side: float
    depth_back: float
    coronal_power: float
    sagittal_power: float
    shape_noise: SphereField
    thickness_mm: float
    thickness_noise: SphereField
    min_thickness_mm: float
    base_drop_deg: tuple[float, float, float]  # how far below the horizon the cut runs: front, sides, back
    base_wave: tuple[tuple[int, float, float], ...]  # (harmonic, amplitude in degrees, phase) around the head
    orbit_direction: np.ndarray  # the right orbit; the left one is its mirror image
    orbit_half_width: float  # tangent of the angular half-width seen from the vault centre
    orbit_half_height: float
    # The placement in the grid; draw_params measures the head in its own frame
    # (identity, origin) before choosing them.
    rotation: np.ndarray = field(default_factory=lambda: np.eye(3))  # head frame -> grid frame
    centre_mm: np.ndarray = field(default_factory=lambda: np.zeros(3))  # head-frame origin in grid physical coordinates

    def radii(self, grid_mm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r, outer, inner, _ = _shell_terms(self, _to_head(self, grid_mm))
        return r, outer, inner

    def bone(self, grid_mm: np.ndarray) -> np.ndarray:
        return _bone(self, _to_head(self, grid_mm))


def draw_params(rng: np.random.Generator, spacing: np.ndarray, extent_mm: np.ndarray) -> DomeParams:
    """A random dome skull placed in a field of view of ``extent_mm``; ConfigError if the head does not fit."""
    sx, sy, sz = 1.0 + rng.uniform(-0.08, 0.08, size=3)
    orbit_centre = np.array([32.0 * sx + rng.uniform(-2.0, 2.0), -86.0 * sy, -30.0 * sz + rng.uniform(-2.0, 2.0)])
    orbit_distance = float(np.linalg.norm(orbit_centre))
    params = DomeParams(
        half_width=72.5 * sx,
        half_length_front=86.0 * sy,
        half_length_back=94.0 * sy,
        height_up=90.0 * sz,
        depth_front=105.0 * sz,
        depth_side=88.0 * sz,
        depth_back=62.0 * sz,
        coronal_power=rng.uniform(2.3, 2.7),
        sagittal_power=rng.uniform(2.0, 2.3),
        shape_noise=SphereField.draw(rng, rng.uniform(0.015, 0.03)),
        thickness_mm=rng.uniform(5.0, 8.0),
        thickness_noise=SphereField.draw(rng, 0.12),
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
    u = fibonacci_sphere(20000).astype(np.float32)
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


def _outer_radius(p: DomeParams, u: np.ndarray) -> np.ndarray:
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
        + 0.05 * bump(u, (0.0, 1.0, -0.15), 0.45)  # occiput
        + 0.02 * bump(u, (0.0, 0.85, -0.5), 0.15)  # external occipital protuberance
        + 0.025 * (bump(u, (0.3, -0.95, 0.0), 0.2) + bump(u, (-0.3, -0.95, 0.0), 0.2))  # brow ridges
        - 0.035 * (bump(u, (0.8, -0.5, -0.3), 0.3) + bump(u, (-0.8, -0.5, -0.3), 0.3))  # temporal fossae
    )
    return radius * factor


def _thickness(p: DomeParams, u: np.ndarray) -> np.ndarray:
    temporal = bump(u, (0.95, -0.05, -0.3), 0.45) + bump(u, (-0.95, -0.05, -0.3), 0.45)
    t = np.float32(p.thickness_mm) * (
        1.0
        + p.thickness_noise(u)
        - 0.35 * temporal
        + 0.3 * bump(u, (0.0, 0.95, -0.35), 0.35)
        + 0.2 * (bump(u, (0.3, -0.95, 0.0), 0.2) + bump(u, (-0.3, -0.95, 0.0), 0.2))
    )
    return np.maximum(t, np.float32(p.min_thickness_mm))


def _obliquity(p: DomeParams, u: np.ndarray, outer: np.ndarray) -> np.ndarray:
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


def _above_base(p: DomeParams, u: np.ndarray) -> np.ndarray:
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


def _in_orbit(p: DomeParams, u: np.ndarray) -> np.ndarray:
    mirrored = np.stack([np.abs(u[0]), u[1], u[2]])
    d = p.orbit_direction
    e1 = unit(np.cross([0.0, 0.0, 1.0], d))
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


def _shell_terms(p: DomeParams, pts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Head-frame points -> (radius, outer radius, inner radius, direction)."""
    r = np.sqrt(np.sum(pts * pts, axis=0))
    u = pts / np.maximum(r, np.float32(1e-6))
    outer = _outer_radius(p, u)
    return r, outer, outer - _thickness(p, u) * _obliquity(p, u, outer), u


def _bone(p: DomeParams, pts: np.ndarray) -> np.ndarray:
    r, outer, inner, u = _shell_terms(p, pts)
    return (r <= outer) & (r >= inner) & _above_base(p, u) & ~_in_orbit(p, u)


def _to_head(p: DomeParams, grid_mm: np.ndarray) -> np.ndarray:
    """Grid physical coordinates (3, N) -> head frame (3, N), float32."""
    shifted = grid_mm - p.centre_mm.astype(np.float32)[:, None]
    return p.rotation.T.astype(np.float32) @ shifted

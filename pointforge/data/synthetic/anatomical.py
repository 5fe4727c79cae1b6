"""The anatomical family: skulls made by deforming one real head, fsaverage's, about as much as heads vary.

The bone lies between the inner surface of the skull of the fsaverage
template (:mod:`pointforge.data.synthetic.fsaverage`) and an outer table built
on a smoothed copy of that surface, pushed out from it by a fraction (40–70 %,
drawn per skull) of the distance to the template's scalp: thinner over the
temples than over the forehead and occiput. A smooth random field varies the
thickness by ±15 % and it is clipped to 3.5–10 mm along the normal (before the
per-axis scaling below). The inner table keeps the template's ridges (frontal
crest, internal occipital protuberance); the outer one does not. The base is
open: everything below a plane through the skull base is cut away, the plane
running just above the floor of the anterior cranial fossa at the front (under
the brow) and down through the occiput behind, each end drawn ±3 mm.

Skull to skull, the template is shrunk to 90 % of its width, 94 % of its
length and 93 % of its height (fsaverage lives in MNI space, larger and
broader than an average head), then scaled on each axis on its own by ±9 %
(width, length, height: the cephalic index varies with them), deformed by a
smooth displacement field (six random plane waves of 90–200 mm wavelength,
4–5 mm root mean square, slope at most 0.6) and a smooth radial field
(spherical harmonics up to l = 3, 1.5–3 % of the radius), and tilted by up
to 5° (pitch) and 3° (roll and yaw). The head is centred in the field of view
up to a shift of at most 4 mm; axes as in :mod:`pointforge.data.synthetic.grid`.

It is one template deformed, not a population of real skulls: no sutures, no
diploë, no skull base or face, no asymmetry beyond the smooth fields. As for
the domes, bone is thickened to two voxels at small sizes and
:func:`~pointforge.data.synthetic.raster.finish_bone` leaves one well-composed piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from scipy.spatial.transform import Rotation

from pointforge.data.synthetic.fsaverage import HeadTemplate, load_template
from pointforge.data.synthetic.raster import skull_on_grid
from pointforge.data.synthetic.sphere import SphereField, fibonacci_sphere
from pointforge.errors import ConfigError

# fsaverage's head is larger and broader than an average adult's (MNI space): scaled by
# these (width, length, height), the mean skull is about 150 mm wide and 188 mm long
# over the outer table (cephalic index 79), a typical adult's.
NOMINAL_SCALE = np.array([0.90, 0.94, 0.93])
SCALE_RANGE = 0.09
THICKNESS_FRACTION = (0.4, 0.7)
THICKNESS_MM = (3.5, 10.0)
_MIN_THICKNESS_VOXELS = 2.0
# The base plane, in template mm about the template's centre: its height at the front
# (y = -95, under the brow) and at the back (y = +95, through the occiput).
_BASE_FRONT, _BASE_BACK, _BASE_SPAN = -33.0, -56.0, 95.0
_WAVES, _WAVELENGTH_MM, _WAVE_AMPLITUDE_MM = 6, (90.0, 200.0), 1.5
_MAX_WARP_SLOPE = 0.6  # keeps the displacement field invertible and the bone's thickness near its drawn value
_MIN_COSINE = 0.4  # thickness along a ray at most 2.5× that along the normal


def make_skull(
    size: int,
    rng: np.random.Generator,
    *,
    shape: tuple[int, int, int] | None = None,
    spacing: tuple[float, float, float] | None = None,
) -> tuple[np.ndarray, tuple[float, float, float]]:
    """A complete anatomical skull: ``(bool volume, spacing in mm)``; grid and spacing as for the domes.

    Draws from ``rng`` only, so the same generator state gives the same skull.
    The geometry is in the module docstring.
    """
    return skull_on_grid(draw_params, size, rng, shape, spacing)


@dataclass(frozen=True)
class Warp:
    """A smooth displacement field in mm: a sum of plane waves ``amplitude · sin(wavevector · q + phase)``."""

    wavevectors: np.ndarray  # (waves, 3) radians per mm
    amplitudes: np.ndarray  # (waves, 3) mm
    phases: np.ndarray  # (waves,)

    @classmethod
    def draw(cls, rng: np.random.Generator) -> "Warp":
        directions = rng.normal(size=(_WAVES, 3))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        wavevectors = directions * (2.0 * np.pi / rng.uniform(*_WAVELENGTH_MM, size=(_WAVES, 1)))
        amplitudes = rng.normal(scale=_WAVE_AMPLITUDE_MM, size=(_WAVES, 3))
        warp = cls(wavevectors, amplitudes, rng.uniform(0.0, 2.0 * np.pi, size=_WAVES))
        slope = warp.max_slope()
        if slope > _MAX_WARP_SLOPE:
            warp = replace(warp, amplitudes=amplitudes * (_MAX_WARP_SLOPE / slope))
        return warp

    def max_slope(self) -> float:
        """An upper bound on the field's derivative (its Lipschitz constant)."""
        return float(np.sum(np.linalg.norm(self.amplitudes, axis=1) * np.linalg.norm(self.wavevectors, axis=1)))

    def __call__(self, q: np.ndarray) -> np.ndarray:
        """The displacement at points ``q`` (3, N), same dtype."""
        out = np.zeros_like(q)
        for k, a, phase in zip(self.wavevectors.astype(q.dtype), self.amplitudes.astype(q.dtype), self.phases):
            wave = np.sin(k[0] * q[0] + k[1] * q[1] + k[2] * q[2] + q.dtype.type(phase))
            out += a[:, None] * wave
        return out

    def invert(self, p: np.ndarray, iterations: int = 30) -> np.ndarray:
        """The ``q`` with ``q + self(q) = p``: a contraction, the slope being below 1."""
        q = p.copy()
        for _ in range(iterations):
            q = p - self(q)
        return q


@dataclass(frozen=True)
class AnatomicalParams:
    """One anatomical skull's deformation of the template and its placement; a :class:`~pointforge.data.synthetic.raster.Shell`.

    A grid point ``x`` (mm) maps into the template as ``h = rotationᵀ (x - centre_mm)``,
    ``q = h / (scale · NOMINAL_SCALE)``, ``p = q + warp(q)``; the bone is then
    judged at ``p`` against the template's surfaces (radially perturbed by
    ``shape_noise``).
    """

    template: HeadTemplate = field(repr=False)
    scale: np.ndarray  # (3,) width, length, height factors about 1
    warp: Warp
    shape_noise: SphereField
    thickness_fraction: float
    thickness_noise: SphereField
    min_thickness_mm: float  # in template mm, along the normal
    base_front: float
    base_back: float
    rotation: np.ndarray = field(default_factory=lambda: np.eye(3))  # head frame -> grid frame
    centre_mm: np.ndarray = field(default_factory=lambda: np.zeros(3))  # head-frame origin in grid coordinates

    def radii(self, grid_mm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # In template mm divided by the map's largest stretch, so that a step of d grid mm
        # changes them by at most d, as rasterize's block test assumes.
        r, outer, inner = _shell_terms(self, self.to_template(grid_mm))
        stretch = np.float32(self.stretch())
        return r / stretch, outer / stretch, inner / stretch

    def bone(self, grid_mm: np.ndarray) -> np.ndarray:
        p = self.to_template(grid_mm)
        r, outer, inner = _shell_terms(self, p)
        return (r <= outer) & (r >= inner) & self.above_base(p)

    def stretch(self) -> float:
        """An upper bound on how much the grid-to-template map lengthens a step."""
        return (1.0 + self.warp.max_slope()) / float((NOMINAL_SCALE * self.scale).min())

    def to_template(self, grid_mm: np.ndarray) -> np.ndarray:
        """Grid coordinates (3, N) -> template coordinates about the template's centre (3, N), float32."""
        shifted = grid_mm - self.centre_mm.astype(np.float32)[:, None]
        q = self.rotation.T.astype(np.float32) @ shifted
        q /= (self.scale * NOMINAL_SCALE).astype(np.float32)[:, None]
        return q + self.warp(q)

    def to_grid(self, p: np.ndarray) -> np.ndarray:
        """Template coordinates (3, N) -> grid coordinates (3, N): :meth:`to_template` inverted."""
        q = self.warp.invert(p)
        return self.rotation @ (q * (self.scale * NOMINAL_SCALE)[:, None]) + self.centre_mm[:, None]

    def above_base(self, p: np.ndarray) -> np.ndarray:
        slope = (self.base_back - self.base_front) / (2.0 * _BASE_SPAN)
        height = (self.base_front + self.base_back) / 2.0 + slope * p[1]
        return p[2] >= height


def draw_params(rng: np.random.Generator, spacing: np.ndarray, extent_mm: np.ndarray) -> AnatomicalParams:
    """A random anatomical skull placed in a field of view of ``extent_mm``; ConfigError if the head does not fit."""
    scale = 1.0 + rng.uniform(-SCALE_RANGE, SCALE_RANGE, size=3)
    params = AnatomicalParams(
        template=load_template(),
        scale=scale,
        warp=Warp.draw(rng),
        shape_noise=SphereField.draw(rng, rng.uniform(0.015, 0.03)),
        thickness_fraction=float(rng.uniform(*THICKNESS_FRACTION)),
        thickness_noise=SphereField.draw(rng, 0.15),
        min_thickness_mm=_MIN_THICKNESS_VOXELS * float(spacing.max()) / float((NOMINAL_SCALE * scale).min()),
        base_front=_BASE_FRONT + float(rng.uniform(-3.0, 3.0)),
        base_back=_BASE_BACK + float(rng.uniform(-3.0, 3.0)),
    )
    pitch, roll, yaw = np.deg2rad(rng.uniform(-1.0, 1.0, size=3) * (5.0, 3.0, 3.0))
    rotation = Rotation.from_euler("xyz", [pitch, roll, yaw]).as_matrix()
    # The outer surface, sampled densely over directions, is centred in the field of
    # view (up to a small random shift).
    placed = replace(params, rotation=rotation)
    surface = placed.to_grid(_outer_surface(placed, fibonacci_sphere(20000).astype(np.float32)))
    box_lo, box_hi = surface.min(axis=1), surface.max(axis=1)
    if np.any(box_hi - box_lo > extent_mm - 8.0):
        raise ConfigError(
            f"field of view {np.round(extent_mm, 1).tolist()} mm is too small for a "
            f"{np.round(box_hi - box_lo, 1).tolist()} mm head; use a larger shape or spacing"
        )
    slack = (extent_mm - (box_hi - box_lo)) / 2.0
    shift = rng.uniform(-1.0, 1.0, size=3) * np.minimum(4.0, np.maximum(slack - 4.0, 0.0))
    return replace(placed, centre_mm=-(box_lo + box_hi) / 2.0 + shift)


def _outer_surface(p: AnatomicalParams, u: np.ndarray) -> np.ndarray:
    """Points of the outer table in template coordinates along directions ``u`` (3, N), above the base only."""
    points = u * _radii(p, u)[0]
    return points[:, p.above_base(points)]


def _radii(p: AnatomicalParams, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(outer, inner) radius of the bone along directions ``u`` (3, N), template mm."""
    inner, smooth_inner, cosine, scalp = p.template(u)
    # Surfaces about parallel: the gap along the normal is the gap along the ray times the cosine.
    cosine = np.maximum(cosine, np.float32(_MIN_COSINE))
    along_normal = np.float32(p.thickness_fraction) * (scalp - smooth_inner) * cosine * (1.0 + p.thickness_noise(u))
    noise = 1.0 + p.shape_noise(u)
    inner *= noise
    # The outer table follows the smoothed inner skull: the inner table's ridges and
    # grooves (frontal crest, internal occipital protuberance) do not show outside.
    smooth_inner *= noise
    lo, hi = (max(np.float32(t / NOMINAL_SCALE.mean()), np.float32(p.min_thickness_mm)) for t in THICKNESS_MM)
    outer = smooth_inner + np.clip(along_normal, lo, hi) / cosine
    return np.maximum(outer, inner + lo / cosine), inner


def _shell_terms(p: AnatomicalParams, points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Template points -> (radius, outer radius, inner radius)."""
    r = np.sqrt(np.sum(points * points, axis=0))
    outer, inner = _radii(p, points / np.maximum(r, np.float32(1e-6)))
    return r, outer, inner

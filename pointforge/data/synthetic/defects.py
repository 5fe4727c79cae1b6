"""Cranial defects in the five SkullBreak classes (and SkullFix's vault defect), cut from any skull.

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

Components are counted with 26-connectivity: every defect region yields exactly one connected
implant piece (``bilateral`` is two regions, one per side, mirrored), and the
defective skull stays one connected piece (bone a cut would leave floating is
moved into the implant).


:func:`make_defect` measures the vault's centre and radii from the voxels, so
it works on every synthetic family and on real skulls in the axis convention of
:mod:`pointforge.data.synthetic.grid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import ndimage

from pointforge.data.surface import bounding_box
from pointforge.data.synthetic.sphere import unit
from pointforge.errors import ConfigError, DataError

DEFECT_CLASSES = ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2")
SKULLFIX_DEFECT = "vault"

_STRUCT26 = np.ones((3, 3, 3), dtype=bool)


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
        if box is None:
            raise DataError("complete skull is empty; cannot cut a defect from it")
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


def _tangent_basis(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    helper = np.array([0.0, 0.0, 1.0]) if abs(d[2]) < 0.95 else np.array([1.0, 0.0, 0.0])
    e1 = unit(np.cross(helper, d))
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
        d = unit(rng.normal(size=3))
        if d[2] >= min_up:
            return d


def _draw_patches(defect_class: str, rng: np.random.Generator, frame: _SkullFrame) -> list[list[tuple[_Patch, bool]]]:
    """Regions (each a union of patches; the flag mirrors a patch left↔right)."""
    if defect_class == "bilateral":
        d = unit([0.62, rng.uniform(-0.1, 0.25), rng.uniform(0.65, 0.85)])
        patch = _Patch(d, (rng.uniform(28, 36), rng.uniform(22, 30)), rng.uniform(-0.5, 0.5), _wave(rng, 0.06))
        return [[(patch, False)], [(patch, True)]]
    if defect_class == "frontoorbital":
        d = unit([rng.uniform(-0.2, 0.2), -1.0, rng.uniform(-0.12, 0.08)])
        patch = _Patch(d, (rng.uniform(34, 44), rng.uniform(30, 38)), rng.uniform(-0.3, 0.3), _wave(rng, 0.06))
        return [[(patch, False)]]
    if defect_class == "parietotemporal":
        side = 1.0 if rng.random() < 0.5 else -1.0
        d = unit([side, rng.uniform(-0.2, 0.25), rng.uniform(0.1, 0.35)])
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
            d = unit(d0 + off * (np.cos(ang) * e1 + np.sin(ang) * e2))
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
    complete: np.ndarray,
    defect_class: str,
    rng: np.random.Generator,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
) -> np.ndarray:
    """The bone a defect of ``defect_class`` removes (the implant), a subset of ``complete``.

    ``defective = complete & ~implant``. Works on any complete skull in the
    grid's axis convention, real ones included; the vault centre and radii are
    measured from the voxels. ``"vault"`` (SkullFix-style) is accepted besides
    :data:`DEFECT_CLASSES`.
    """
    complete = np.asarray(complete)
    if complete.ndim != 3 or complete.dtype != bool:
        raise DataError(f"complete skull must be a 3-D bool volume, got {complete.dtype} of shape {complete.shape}")
    # All the work happens inside the skull's bounding box: at 512³ that halves it.
    crop = bounding_box(complete, margin=1)
    if crop is None:
        raise DataError("complete skull is empty; cannot cut a defect from it")
    spacing_mm = np.asarray(spacing, dtype=np.float64)
    if spacing_mm.shape != (3,) or not np.all(np.isfinite(spacing_mm)) or np.any(spacing_mm <= 0):
        raise ConfigError(f"spacing must be 3 positive numbers (mm), got {spacing_mm.tolist()}")
    full, complete = complete, complete[crop]
    frame = _SkullFrame.of(complete, spacing_mm)
    regions = _draw_patches(defect_class, rng, frame)

    idx, u = frame.index, frame.direction
    mirrored_u = u * np.array([-1.0, 1.0, 1.0], dtype=np.float32)
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

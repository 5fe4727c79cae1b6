"""Directions and smooth random fields on the unit sphere, shared by the skull families and the defects.

A skull is drawn in polar form about the centre of its vault: radii, thickness
and cut-outs are functions of the direction ``u`` (a ``(3, N)`` array of unit
vectors), so these are the shared building blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def fibonacci_sphere(n: int) -> np.ndarray:
    i = np.arange(n) + 0.5
    z = 1.0 - 2.0 * i / n
    phi = np.pi * (1.0 + 5**0.5) * i
    s = np.sqrt(1.0 - z * z)
    return np.stack([s * np.cos(phi), s * np.sin(phi), z])


_FIELD_DEGREE = 3


@dataclass(frozen=True)
class SphereField:
    """A random smooth function on the unit sphere with zero mean.

    A polynomial of degree ≤ 3 in the direction's coordinates: on the sphere these
    span the spherical harmonics up to l = 3, i.e. a few broad bumps and dents.
    ``coeffs[a, b, c]`` multiplies x^a y^b z^c.
    """

    coeffs: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, amplitude: float) -> "SphereField":
        n = _FIELD_DEGREE + 1
        raw = np.zeros((n, n, n))
        for a in range(n):
            for b in range(n - a):
                for c in range(1 if a + b == 0 else 0, n - a - b):
                    # Higher orders weaker, so the field stays smooth.
                    raw[a, b, c] = rng.normal() / (1.0 + a + b + c)
        probe = _eval_poly(fibonacci_sphere(600), raw)
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

    def in_z(a: int, b: int) -> np.ndarray:
        highest, *rest = (coeffs[a, b, c].astype(x.dtype) for c in reversed(range(n - a - b)))
        h = np.full_like(z, highest)
        for k in rest:
            h = _mul_add(h, z, k)
        return h

    def in_yz(a: int) -> np.ndarray:
        g = in_z(a, n - a - 1)
        for b in reversed(range(n - a - 1)):
            g = _mul_add(g, y, in_z(a, b))
        return g

    out = in_yz(n - 1)
    for a in reversed(range(n - 1)):
        out = _mul_add(out, x, in_yz(a))
    return out


def _mul_add(acc: np.ndarray, factor: np.ndarray, term: np.ndarray | np.floating) -> np.ndarray:
    acc *= factor
    acc += term
    return acc


def bump(u: np.ndarray, centre: Sequence[float], width: float) -> np.ndarray:
    """A smooth bump on the sphere around ``centre``, 1 at its centre, ``width`` in chord length."""
    c = np.asarray(centre, dtype=np.float64)
    c = (c / np.linalg.norm(c)).astype(np.float32)
    chord2 = 2.0 - 2.0 * (c[0] * u[0] + c[1] * u[1] + c[2] * u[2])
    return np.exp(chord2 * np.float32(-1.0 / (width * width)))


def unit(v: Sequence[float] | np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)

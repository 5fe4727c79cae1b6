"""A volume's voxel axes turned to follow its physical axes: the orientation every network sees.

Scanners store the same head with its voxel axes in any order and either
sense; the header's direction matrix says how they lie in physical space. A
network that reads voxel indices (PCDiff's points, the voxelizer's cube, the
atlas registration, which starts from the identity rotation) would see such a
skull turned or mirrored. :func:`canonical_axes` transposes and flips the
array so that voxel axis ``a`` runs along physical axis ``a`` in its positive
sense (the direction becomes the nearest it can be to the identity: exactly it
for a permuted or flipped header; an oblique one, e.g. a gantry tilt of a few
degrees, keeps its small rotation). No voxel is interpolated, and the
volume's physical placement is unchanged: ``voxel_to_physical`` of the
turned volume at the turned index is the same point.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pointforge.data.volumes import Volume

__all__ = ["AxisTurn", "canonical_axes"]


@dataclass(frozen=True)
class AxisTurn:
    """How :func:`canonical_axes` turned a volume of shape ``shape``.

    New axis ``a`` is old axis ``perm[a]``, reversed where ``flips[a]``:
    new index ``q`` is old index ``p`` with ``p[perm[a]] = q[a]`` (or
    ``shape[perm[a]] - 1 - q[a]`` when flipped).
    """

    perm: tuple[int, int, int]
    flips: tuple[bool, bool, bool]
    shape: tuple[int, int, int]  # the old (input) shape

    @property
    def identity(self) -> bool:
        return self.perm == (0, 1, 2) and not any(self.flips)

    def turn(self, data: np.ndarray) -> np.ndarray:
        """An array on the old grid → the same on the new grid."""
        if self.identity:
            return data
        out = np.transpose(data, self.perm)
        flipped = tuple(a for a in range(3) if self.flips[a])
        return np.ascontiguousarray(np.flip(out, flipped) if flipped else out)

    def unturn(self, data: np.ndarray) -> np.ndarray:
        """An array on the new grid → the same on the old grid."""
        if self.identity:
            return data
        flipped = tuple(a for a in range(3) if self.flips[a])
        out = np.flip(data, flipped) if flipped else data
        return np.ascontiguousarray(np.transpose(out, np.argsort(self.perm)))

    def points_to_old(self, points: np.ndarray) -> np.ndarray:
        """Index coordinates ``[..., 3]`` on the new grid → on the old grid."""
        q = np.asarray(points, dtype=np.float64)
        p = np.empty_like(q)
        for a in range(3):
            old = self.perm[a]
            p[..., old] = (self.shape[old] - 1) - q[..., a] if self.flips[a] else q[..., a]
        return p


def _axis_turn(direction: np.ndarray, shape: tuple[int, int, int]) -> AxisTurn:
    """The signed permutation nearest ``direction`` (column ``i``: old axis ``i``'s unit vector)."""
    weight = np.abs(np.asarray(direction, dtype=np.float64))
    perm = [-1, -1, -1]
    free_rows, free_cols = [0, 1, 2], [0, 1, 2]
    for _ in range(3):  # greedily the strongest remaining (physical axis, old axis) pair: exact for any turn
        sub = weight[np.ix_(free_rows, free_cols)]
        r, c = np.unravel_index(int(np.argmax(sub)), sub.shape)
        row, col = free_rows.pop(int(r)), free_cols.pop(int(c))
        perm[row] = col
    flips = tuple(bool(direction[a, perm[a]] < 0) for a in range(3))
    return AxisTurn(perm=(perm[0], perm[1], perm[2]), flips=flips, shape=shape)  # type: ignore[arg-type]


def canonical_axes(volume: Volume) -> tuple[Volume, AxisTurn]:
    """``volume`` with its voxel axes along its physical axes (module docs), and the turn that was applied.

    A volume already so oriented (the identity turn) comes back as it is.
    """
    turn = _axis_turn(np.asarray(volume.direction, dtype=np.float64), volume.shape)
    if turn.identity:
        return volume, turn
    affine = volume.affine()
    # new index q → old index p = M q + t; physical = A (M q + t) + o
    m = np.zeros((3, 3))
    t = np.zeros(3)
    for a in range(3):
        old = turn.perm[a]
        m[old, a] = -1.0 if turn.flips[a] else 1.0
        t[old] = volume.shape[old] - 1 if turn.flips[a] else 0.0
    linear = affine[:3, :3] @ m
    spacing = np.linalg.norm(linear, axis=0)
    turned = replace(
        volume,
        data=turn.turn(volume.data),
        spacing=(float(spacing[0]), float(spacing[1]), float(spacing[2])),
        origin=tuple(float(x) for x in affine[:3, :3] @ t + affine[:3, 3]),  # type: ignore[arg-type]
        direction=linear / spacing[None, :],
        path=None,
    )
    return turned, turn

"""Voxel axes turned to follow the header's physical axes: no voxel moves in physical space."""

from __future__ import annotations

import numpy as np

from pointforge.data.orientation import canonical_axes
from pointforge.data.volumes import Volume


def turned_copy(volume: Volume, perm, flips) -> Volume:
    """The same physical volume stored with its axes permuted (new axis a = old perm[a]) and flipped."""
    data = np.transpose(volume.data, perm)
    data = np.ascontiguousarray(np.flip(data, tuple(a for a in range(3) if flips[a])))
    m, t = np.zeros((3, 3)), np.zeros(3)
    for a in range(3):
        m[perm[a], a] = -1.0 if flips[a] else 1.0
        t[perm[a]] = data.shape[a] - 1 if flips[a] else 0.0
    linear = volume.affine()[:3, :3] @ m
    spacing = np.linalg.norm(linear, axis=0)
    origin = volume.affine()[:3, :3] @ t + np.asarray(volume.origin)
    return Volume(data=data, spacing=tuple(spacing), origin=tuple(origin), direction=linear / spacing)


def test_a_permuted_and_flipped_header_is_turned_back_exactly():
    rng = np.random.default_rng(0)
    original = Volume(data=rng.uniform(size=(5, 7, 9)) < 0.3, spacing=(0.4, 0.5, 0.7), origin=(-3.0, 4.0, 10.0))
    stored = turned_copy(original, (2, 0, 1), (False, True, True))
    assert stored.shape == (9, 5, 7) and not np.allclose(stored.direction, np.eye(3))

    turned, turn = canonical_axes(stored)
    assert not turn.identity
    np.testing.assert_allclose(turned.direction, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(turned.spacing, original.spacing)
    np.testing.assert_allclose(turned.origin, original.origin, atol=1e-9)
    assert np.array_equal(turned.data, original.data)
    assert np.array_equal(turn.unturn(turned.data), stored.data)
    assert np.array_equal(turn.turn(stored.data), turned.data)
    # A point in the turned grid's voxel coordinates is the same physical point in the stored grid's.
    points = rng.uniform(0, 4, size=(20, 3))
    np.testing.assert_allclose(
        stored.voxel_to_physical(turn.points_to_old(points)), turned.voxel_to_physical(points), atol=1e-9
    )


def test_an_oblique_header_keeps_its_axes_and_an_aligned_one_is_left_alone():
    tilt = np.deg2rad(9.0)  # a gantry tilt as in SkullFix 000: nearest turn is none
    oblique = np.array([[1, 0, 0], [0, np.cos(tilt), np.sin(tilt)], [0, -np.sin(tilt), np.cos(tilt)]])
    for direction in (np.eye(3), oblique):
        volume = Volume(data=np.zeros((3, 4, 5), dtype=bool), direction=direction)
        turned, turn = canonical_axes(volume)
        assert turn.identity and turned is volume

"""The way back from the isotropic work grid to an anisotropic input grid (``pipeline._to_input_grid``).

It interpolates only the box of input voxels that can reach the implant; the result must be the
whole-volume linear transform's, bit for bit: every voxel of every implant, proposal and agreement
map written for an anisotropic scan comes through it."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import affine_transform

from pointforge.implant.pipeline import _exact_start, _to_input_grid


def _whole(values: np.ndarray, scale: np.ndarray, shape: tuple[int, ...], binary: bool) -> np.ndarray:
    out = affine_transform(values.astype(np.float32), 1.0 / scale, output_shape=shape, order=1, mode="nearest")
    return out >= 0.5 if binary else out.astype(np.float32)


def _case(rng: np.random.Generator, trial: int):
    spacing = np.array([rng.uniform(0.3, 0.5), rng.uniform(0.3, 0.5), rng.uniform(0.5, 1.0)])
    shape = tuple(int(n) for n in rng.integers(20, 50, 3))
    work = tuple(int(n) for n in np.floor((np.array(shape) - 1) * spacing / spacing.min() + 1e-6).astype(int) + 1)
    lo = [0, 0, 0] if trial % 5 == 0 else [int(rng.integers(0, n - 2)) for n in work]
    hi = list(work) if trial % 7 == 0 else [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, work)]
    part = tuple(slice(a, b) for a, b in zip(lo, hi))
    binary = trial % 2 == 0
    values = np.zeros(work, bool if binary else np.float32)
    size = values[part].shape
    values[part] = rng.random(size) < 0.5 if binary else rng.random(size).astype(np.float32)
    return values, spacing.min() / spacing, shape, binary


def test_the_boxed_transform_is_the_whole_volume_one_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(40):  # boxes inside, at the grid's ends, masks and agreement maps
        values, scale, shape, binary = _case(rng, trial)
        got = _to_input_grid(values, scale, shape, binary=binary)
        want = _whole(values, scale, shape, binary)
        assert got.dtype == want.dtype and np.array_equal(got, want), trial


def test_an_empty_work_array_maps_to_zeros_and_an_isotropic_one_is_returned_as_is():
    scale = np.array([1.0, 1.0, 0.72])
    empty = _to_input_grid(np.zeros((30, 30, 40), bool), scale, (30, 30, 29), binary=True)
    assert empty.shape == (30, 30, 29) and not empty.any()
    values = np.ones((4, 4, 4), bool)
    assert _to_input_grid(values, None, (4, 4, 4), binary=True) is values


@pytest.mark.parametrize("zoom", [1.0, 1.3888888888888888, 1.5646901831446440, 2.0 / 3.0])
def test_each_start_is_one_where_scipys_shift_is_exact(zoom):
    starts = [slice(s, s + 5) for s in range(0, 400, 3)]
    for wanted in starts:
        (box,), offset = _exact_start((wanted,), np.array([zoom]))
        assert box.start <= wanted.start and box.stop == wanted.stop
        assert np.float64(offset[0]) / np.float64(zoom) == box.start

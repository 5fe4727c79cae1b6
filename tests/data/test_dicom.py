"""A CT series → the skull: sorted by position, tilt and uneven spacing resampled, the rest refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pointforge.data.ct_stack import MAX_SLICE_MM
from pointforge.data.dicom import ct_series_from_bytes, is_dicom_series, read_ct_series
from pointforge.errors import DataError
from tests.dicom_series import ct_series_zip, ct_slices, in_folder, shell_hounsfield, zipped
from tests.helpers import shell_mask

CENTRE, RADIUS, THICKNESS = (20.0, 22.0, 30.0), 16.0, 4.0
SHELL = shell_hounsfield(CENTRE, RADIUS, THICKNESS)


def shell_error_mm(series) -> float:
    """The largest distance of a kept voxel's centre from the true shell (0 inside it)."""
    points = series.skull.voxel_to_physical(np.argwhere(series.skull.data))
    distance = np.linalg.norm(points - np.asarray(CENTRE), axis=1)
    return float(np.maximum(distance - RADIUS, RADIUS - THICKNESS - distance).max())


def axial_positions(depths, origin=(0.0, 0.0, 0.0)):
    return [(origin[0], origin[1], origin[2] + d) for d in depths]


def test_an_axial_series_becomes_the_largest_bone_component_on_an_isotropic_grid(tmp_path):
    skull = shell_mask((40, 40, 20), radii=(15, 14, 8), thickness=2.5)
    hounsfield = np.where(skull, 1200.0, 20.0).astype(np.float32)
    hounsfield[1:3, 1:3, 1:3] = 1500.0  # a loose fragment: not the skull
    (tmp_path / "ct.zip").write_bytes(ct_series_zip(hounsfield, spacing=(0.8, 0.8, 1.6)))
    series = read_ct_series(tmp_path / "ct.zip")
    volume = series.skull
    assert np.allclose(volume.spacing, 0.8) and volume.shape == (40, 40, 39)
    assert not volume.data[1:3, 1:3, 1:5].any(), "the loose fragment was kept"
    assert abs(int(volume.data.sum()) / (2 * skull.sum()) - 1) < 0.15
    assert np.allclose(volume.origin, (-10.0, -20.0, 5.0))
    assert all("PixelData" not in ds for ds in series.headers), "the headers kept their pixels"
    assert [float(ds.ImagePositionPatient[2]) for ds in series.headers] == [5.0 + 1.6 * k for k in range(20)]
    assert any("left out 1 smaller piece" in note for note in series.notes), series.notes


def test_a_folder_and_a_zip_of_the_same_series_read_the_same(tmp_path):
    files = ct_slices(SHELL, axial_positions(np.arange(0, 60, 1.0)), size=(44, 44))
    folder = in_folder(files, tmp_path / "series")
    (tmp_path / "series.zip").write_bytes(zipped(files))
    assert is_dicom_series(folder) and is_dicom_series(tmp_path / "series.zip")
    assert not is_dicom_series(tmp_path)  # a folder of folders is not a series
    a, b = read_ct_series(folder), read_ct_series(tmp_path / "series.zip")
    assert np.array_equal(a.skull.data, b.skull.data) and a.frame_of_reference_uid == b.frame_of_reference_uid
    assert shell_error_mm(a) <= math.sqrt(3) / 2 + 0.05


def test_a_tilted_stack_is_resampled_onto_a_grid_perpendicular_to_its_slices():
    tilt = math.radians(18.5)
    # A gantry tilted about the patient's left-right axis: slices in the plane of x and (0, cos, -sin),
    # each placed straight up the table (z), so the stack is sheared within the slice plane.
    orientation = (1.0, 0.0, 0.0, 0.0, math.cos(tilt), -math.sin(tilt))
    positions = [(0.0, -5.0, z) for z in np.arange(0.0, 64.0, 1.0 / math.cos(tilt))]
    files = ct_slices(SHELL, positions, size=(44, 62), orientation=orientation)
    series = ct_series_from_bytes(files)
    assert any("gantry tilt of 18.5°" in note for note in series.notes), series.notes
    assert np.allclose(series.skull.direction[:, 1], orientation[3:])
    assert shell_error_mm(series) <= math.sqrt(3) / 2 + 0.1, "the shear was not undone"
    assert series.skull.data.sum() > 0.8 * 4 / 3 * math.pi * (RADIUS**3 - (RADIUS - THICKNESS) ** 3)


def test_uneven_spacing_is_resampled_evenly():
    depths = np.concatenate([np.arange(0, 30, 1.0), 30 + np.arange(0, 34, 1.5)])
    files = ct_slices(SHELL, axial_positions(depths), size=(44, 44))
    series = ct_series_from_bytes(files)
    assert any("uneven slice spacing (1-1.5 mm)" in note for note in series.notes), series.notes
    assert np.allclose(series.skull.spacing, 1.0)
    assert shell_error_mm(series) <= math.sqrt(3) / 2 + 0.3


@pytest.mark.parametrize(
    "depths, reason",
    [
        ([0, 1, 2, 3, 3, 4, 5], "a repeated slice or a second stack"),
        ([0, 1, 2, 3, 6, 7, 8], "slices are missing"),
        ([0, 4, 8, 12], f"an implant needs at most {MAX_SLICE_MM:g} mm: reconstruct thin slices"),
    ],
)
def test_a_stack_that_cannot_make_a_skull_is_refused_in_one_line(depths, reason):
    files = ct_slices(SHELL, axial_positions(depths), size=(8, 8))
    with pytest.raises(DataError, match=reason) as caught:
        ct_series_from_bytes(files)
    assert "\n" not in str(caught.value)


def test_a_series_without_rescale_tags_is_refused():
    files = ct_slices(SHELL, axial_positions(range(6)), size=(44, 44), rescale=False)
    with pytest.raises(DataError, match="no RescaleSlope/RescaleIntercept"):
        ct_series_from_bytes(files)


def test_two_series_or_no_ct_are_refused():
    one = ct_slices(SHELL, axial_positions(range(4)), size=(8, 8))
    other = ct_slices(SHELL, axial_positions(range(4)), size=(8, 8))
    with pytest.raises(DataError, match="2 DICOM series"):
        ct_series_from_bytes(one + other)
    with pytest.raises(DataError, match="not CT"):
        ct_series_from_bytes(ct_slices(SHELL, axial_positions(range(4)), size=(8, 8), modality="MR"))
    with pytest.raises(DataError, match="no DICOM images found"):
        ct_series_from_bytes([b"hello"])

"""An upload is checked from its content: type by magic bytes, 3-D binary volumes, safe zips, CT series."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pointforge.data.volumes import write_volume
from pointforge.errors import DataError
from pointforge.serve.uploads import check_upload
from tests.dicom_series import ct_series_zip
from tests.helpers import shell_mask

LIMITS = {"max_voxels": 200**3, "max_unzipped": 50 * 2**20}


def check(tmp_path: Path, payload: bytes):
    raw = tmp_path / "incoming.part"
    raw.write_bytes(payload)
    return check_upload(raw, tmp_path / "stored", **LIMITS)


def nrrd_bytes(tmp_path: Path, data: np.ndarray) -> bytes:
    return write_volume(tmp_path / "v.nrrd", data).read_bytes()


def test_a_binary_nrrd_and_nifti_are_stored_under_the_servers_name(tmp_path):
    mask = shell_mask((24, 24, 24), radii=(9, 8, 7)).astype(np.uint8) * 255
    done = check(tmp_path, nrrd_bytes(tmp_path, mask))
    assert (done.kind, done.shape) == ("nrrd", (24, 24, 24)) and (tmp_path / "stored.nrrd").is_file()
    nifti = write_volume(tmp_path / "v.nii.gz", mask).read_bytes()
    assert check(tmp_path, nifti).kind == "nifti-gz" and (tmp_path / "stored.nii.gz").is_file()


def test_a_png_renamed_nrrd_is_refused_by_its_content(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + bytes(200)
    with pytest.raises(DataError, match="not a NRRD, NIfTI or zipped DICOM series \\(it is a PNG image\\)"):
        check(tmp_path, png)
    assert not list(tmp_path.glob("stored*"))


@pytest.mark.parametrize(
    "data, reason",
    [
        (np.ones((20, 20), np.uint8), "expected a 3-D volume"),
        (np.arange(8000, dtype=np.uint8).reshape(20, 20, 20) % 7, "not a binary mask"),
    ],
    ids=["2-D volume", "non-binary mask"],
)
def test_a_volume_that_is_not_a_3d_binary_mask_is_refused_in_one_line(tmp_path, data, reason):
    import nrrd

    nrrd.write(str(tmp_path / "v.nrrd"), data)
    with pytest.raises(DataError, match=reason) as err:
        check(tmp_path, (tmp_path / "v.nrrd").read_bytes())
    assert "\n" not in str(err.value) and "incoming" not in str(err.value)
    assert not list(tmp_path.glob("stored*"))


def test_a_nrrd_naming_a_detached_data_file_is_refused(tmp_path):
    header = b"NRRD0004\ntype: uint8\ndimension: 3\nsizes: 2 2 2\nencoding: raw\ndata file: ../../etc/passwd\n\n"
    with pytest.raises(DataError, match="detached data file"):
        check(tmp_path, header)


def test_a_header_promising_too_many_voxels_is_refused_before_reading(tmp_path):
    header = b"NRRD0004\ntype: uint8\ndimension: 3\nsizes: 4000 4000 4000\nencoding: gzip\n\n" + bytes(64)
    with pytest.raises(DataError, match="voxels"):
        check(tmp_path, header)


def zipped(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, body in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, body)
    return out.getvalue()


@pytest.mark.parametrize("name", ["../evil.dcm", "series/../../evil.dcm", "/etc/evil.dcm", "C:/evil.dcm"])
def test_zip_members_with_traversal_or_absolute_names_are_refused(tmp_path, name):
    with pytest.raises(DataError, match="absolute or '..' path"):
        check(tmp_path, zipped({"ok.dcm": b"x", name: b"y"}))


def test_a_zip_bomb_is_refused_from_its_directory(tmp_path):
    with pytest.raises(DataError, match="zip bomb"):
        check(tmp_path, zipped({"slice.dcm": bytes(20 * 2**20)}))


def test_a_ct_series_is_checked_whole_and_kept_as_the_zip(tmp_path):
    skull = shell_mask((40, 40, 20), radii=(15, 14, 8), thickness=2.5)
    hounsfield = np.where(skull, 1200.0, 20.0).astype(np.float32)
    payload = ct_series_zip(hounsfield, spacing=(0.8, 0.8, 1.6))
    done = check(tmp_path, payload)
    assert done.kind == "dicom-zip" and done.suffix == ".zip"
    assert done.shape == (40, 40, 39)  # 20 slices 1.6 mm apart, resampled every 0.8 mm
    assert (tmp_path / "stored.zip").read_bytes() == payload


def test_a_ct_series_without_bone_is_refused_at_upload(tmp_path):
    with pytest.raises(DataError, match="no voxel reaches 300 HU"):
        check(tmp_path, ct_series_zip(np.full((12, 12, 6), 20.0, np.float32)))
    assert not (tmp_path / "stored.zip").exists()


def test_a_series_that_is_not_ct_is_refused(tmp_path):
    with pytest.raises(DataError, match="not CT"):
        check(tmp_path, ct_series_zip(np.zeros((8, 8, 4), np.float32), modality="MR"))

import gzip
import re
import zlib

import nrrd
import numpy as np
import pytest

from pointforge.data.nrrd_deflate import deflate_backend
from pointforge.data.volumes import (
    Volume,
    nonzero_box,
    read_binary_volume,
    read_volume,
    to_binary,
    transposed_copy,
    write_volume,
)
from pointforge.errors import DataError


def _rotation(seed=0):
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    return q * np.sign(np.linalg.det(q))


@pytest.mark.parametrize("suffix", [".nrrd", ".nii.gz", ".nii"])
def test_round_trip_keeps_voxels_and_geometry(tmp_path, suffix):
    data = np.random.default_rng(1).random((9, 11, 13)) > 0.5
    direction = _rotation()
    first = read_binary_volume(
        write_volume(
            tmp_path / f"a{suffix}", data, spacing=(0.3, 0.5, 0.8), origin=(1.5, -2.25, 3.125), direction=direction
        )
    )
    assert first.data.dtype == bool and (first.data == data).all()
    assert read_volume(tmp_path / f"a{suffix}").data.flags.c_contiguous  # C-ordered, whatever the reader gives
    # NIfTI stores its affine in float32; NRRD in decimal text of full precision.
    tol = 1e-6 if suffix != ".nrrd" else 1e-12
    np.testing.assert_allclose(first.spacing, (0.3, 0.5, 0.8), atol=tol)
    np.testing.assert_allclose(first.origin, (1.5, -2.25, 3.125), atol=tol)
    np.testing.assert_allclose(first.direction, direction, atol=tol)
    # Read → write → read is exact in both formats.
    second = read_binary_volume(write_volume(tmp_path / f"b{suffix}", first))
    assert second.spacing == first.spacing and second.origin == first.origin
    assert np.array_equal(second.direction, first.direction)
    assert np.array_equal(second.affine(), first.affine())


def test_nrrd_extra_header_fields_survive(tmp_path):
    path = tmp_path / "x.nrrd"
    header = {
        "space": "left-posterior-superior",
        "space directions": np.diag([0.4, 0.4, 0.4]),
        "space origin": np.array([-100.0, -90.0, 10.0]),
        "patient_id": "case-7",
    }
    nrrd.write(str(path), np.ones((4, 5, 6), np.uint8) * 255, header, index_order="F")
    vol = read_binary_volume(path)
    assert vol.spacing == (0.4, 0.4, 0.4) and vol.origin == (-100.0, -90.0, 10.0)
    out = write_volume(tmp_path / "y.nrrd", vol.with_data(np.zeros((4, 5, 6), bool)))
    _, h = nrrd.read(str(out))
    assert h["patient_id"] == "case-7"
    np.testing.assert_array_equal(h["space directions"], np.diag([0.4, 0.4, 0.4]))


def test_voxel_physical_mapping_is_inverse():
    vol = Volume(np.zeros((3, 3, 3)), spacing=(0.3, 0.5, 0.8), origin=(1, 2, 3), direction=_rotation(2))
    ijk = np.random.default_rng(0).random((10, 3)) * 3
    np.testing.assert_allclose(vol.physical_to_voxel(vol.voxel_to_physical(ijk)), ijk, atol=1e-12)
    # Axis i moves by spacing[i] along direction column i.
    np.testing.assert_allclose(
        vol.voxel_to_physical([[0, 1, 0]]) - vol.voxel_to_physical([[0, 0, 0]]), [vol.direction[:, 1] * 0.5], atol=1e-12
    )


def test_label_values_0_255_and_bool():
    assert to_binary(np.array([[[0, 255]]], np.uint8)).tolist() == [[[False, True]]]
    assert to_binary(np.array([[[0, 1]]], np.int16)).tolist() == [[[False, True]]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b""), "empty"),
        (
            lambda p: p.write_bytes(
                b"NRRD0004\ntype: uchar\ndimension: 3\nsizes: 10 10 10\nencoding: raw\n\n" + b"\0" * 50
            ),
            "truncated",
        ),
        (lambda p: p.write_bytes(b"this is not a volume at all" * 10), "cannot read"),
    ],
    ids=["missing", "zero-bytes", "truncated", "garbage"],
)
def test_bad_files_give_one_clear_error(tmp_path, make, message):
    path = tmp_path / "bad.nrrd"
    make(path)
    with pytest.raises(DataError) as err:
        read_binary_volume(path)
    text = str(err.value)
    assert str(path) in text and message in text and "\n" not in text


def test_truncated_gzip_nrrd(tmp_path):
    good = write_volume(tmp_path / "good.nrrd", np.random.default_rng(0).random((30, 30, 30)) > 0.5)
    blob = good.read_bytes()
    bad = tmp_path / "cut.nrrd"
    bad.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_volume(bad)


def test_non_3d_non_binary_empty(tmp_path):
    nrrd.write(str(tmp_path / "flat.nrrd"), np.ones((5, 5), np.uint8))
    with pytest.raises(DataError, match="3-D"):
        read_volume(tmp_path / "flat.nrrd")
    write_volume(tmp_path / "labels.nrrd", np.arange(27, dtype=np.uint8).reshape(3, 3, 3))
    with pytest.raises(DataError, match="not a binary mask"):
        read_binary_volume(tmp_path / "labels.nrrd")
    write_volume(tmp_path / "zero.nrrd", np.zeros((3, 3, 3), np.uint8))
    with pytest.raises(DataError, match="empty"):
        read_binary_volume(tmp_path / "zero.nrrd")
    assert not read_binary_volume(tmp_path / "zero.nrrd", allow_empty=True).data.any()


def test_unknown_suffix(tmp_path):
    with pytest.raises(DataError, match="unknown volume format"):
        read_volume(tmp_path / "x.mha")


def test_write_is_atomic_on_failure(tmp_path, monkeypatch):
    import nrrd as nrrd_module

    target = tmp_path / "keep.nrrd"
    write_volume(target, np.ones((3, 3, 3), bool))
    before = target.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(nrrd_module, "write", boom)
    with pytest.raises(OSError):
        write_volume(target, np.zeros((3, 3, 3), bool))
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.nrrd"]


def _without_write_time(content: bytes) -> bytes:
    lines = content.split(b"\n")
    stamped = [
        k for k, line in enumerate(lines[:4]) if re.fullmatch(rb"# on \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\(GMT\)\.", line)
    ]
    assert len(stamped) == 1, lines[:4]
    return b"\n".join(lines[: stamped[0]] + lines[stamped[0] + 1 :])


def _split(path) -> tuple[bytes, bytes]:
    """An attached NRRD file's header (up to its blank line) and its data bytes."""
    raw = path.read_bytes()
    end = raw.index(b"\n\n") + 2
    return raw[:end], raw[end:]


def test_nrrd_data_is_deflated_by_isal_as_one_gzip_member(tmp_path):
    """The gzip stream is ISA-L's (python-isal is a dependency), one member, and pynrrd reads it back."""
    data = np.zeros((64, 64, 64), dtype=np.uint8)
    data[10:50, 20:30, 5:60] = 1
    path = write_volume(tmp_path / "m.nrrd", data)
    head, body = _split(path)
    assert deflate_backend() == "isal" and b"encoding: gzip\n" in head and b"encoding: raw" not in head
    decompressor = zlib.decompressobj(zlib.MAX_WBITS | 16)
    assert decompressor.decompress(body) == transposed_copy(data).tobytes() and decompressor.eof
    assert decompressor.unused_data == b""
    assert np.array_equal(read_volume(path).data, data)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.uint16])
def test_nrrd_files_hold_the_bytes_pynrrd_writes_in_fortran_order(tmp_path, dtype):
    """The blocked transposed copy handed to pynrrd in C order, deflated by ISA-L, gives the header and (inflated)
    the data bytes pynrrd's own index_order='F' file gives."""
    data = (np.random.default_rng(0).random((37, 20, 45)) * 200).astype(dtype)
    ours = write_volume(tmp_path / "ours.nrrd", data, spacing=(0.5, 0.6, 0.7), compression_level=1)
    header = nrrd.read_header(str(ours))
    header.pop("sizes"), header.pop("type"), header.pop("dimension"), header.pop("endian", None)
    nrrd.write(str(tmp_path / "plain.nrrd"), data, header, index_order="F", compression_level=1)
    # pynrrd stamps the second of writing into a comment line ("# on 2026-11-25 19:56:32(GMT)."), which differs
    # when the two writes straddle a second; every other byte must be the same.
    (our_head, our_body), (head, body) = (_split(p) for p in (ours, tmp_path / "plain.nrrd"))
    assert _without_write_time(our_head) == _without_write_time(head)
    assert gzip.decompress(our_body) == gzip.decompress(body)
    back = read_volume(ours).data
    assert back.flags.c_contiguous and np.array_equal(back, data)


def test_transposed_copy_is_the_transpose():
    data = np.arange(33 * 17 * 40, dtype=np.int32).reshape(33, 17, 40)
    for block in (1, 4, 16, 64):
        out = transposed_copy(data, block=block)
        assert out.flags.c_contiguous and np.array_equal(out, data.T)
    assert np.array_equal(transposed_copy(data.T), data) and transposed_copy(data.T).flags.c_contiguous


def test_transposed_copy_of_a_sparse_volume_copies_its_box_and_is_the_transpose():
    """Only the non-zero box is copied; the result is still every byte of data.T, whatever the dtype and box."""
    rng = np.random.default_rng(1)
    for dtype in (np.bool_, np.uint8, np.uint16, np.float32, np.float64):
        for shape, box in (
            ((30, 21, 40), (slice(3, 9), slice(0, 21), slice(17, 18))),
            ((8, 9, 7), (slice(7, 8), slice(8, 9), slice(6, 7))),
        ):
            data = np.zeros(shape, dtype=dtype)
            data[box] = (rng.random(data[box].shape) * 5 + 1).astype(dtype)  # every voxel of the box non-zero
            assert nonzero_box(data) == box
            for block in (1, 4, 16):
                out = transposed_copy(data, block=block)
                assert out.flags.c_contiguous and np.array_equal(out, data.T)
                assert out.tobytes() == data.tobytes("F")
    assert nonzero_box(np.zeros((4, 5, 6), np.float32)) is None
    assert np.array_equal(transposed_copy(np.zeros((4, 5, 6), np.float32)), np.zeros((6, 5, 4)))
    # -0.0 equals 0 but is not all-zero bytes: it is copied, so the file's bytes stay those of the array.
    negative_zero = np.zeros((5, 6, 7), np.float32)
    negative_zero[4, 5, 6] = -0.0
    assert nonzero_box(negative_zero) == (slice(4, 5), slice(5, 6), slice(6, 7))
    assert transposed_copy(negative_zero).tobytes() == negative_zero.tobytes("F")

"""An upload, checked from its content before it may enter the queue.

The client's file name is a label only: the type comes from the first bytes
(NRRD's ``NRRD000`` header, NIfTI's magic, a zip's local header), and the
stored file is named by the server (``uploads/<job id>.<ext>``). A volume is
read with the project's own reader (3-D, binary, one foreground value) and
its header must promise no more than ``max_voxels`` voxels before anything is
decompressed; a NRRD may not name a detached data file (that would be a path
the client chose). A zip is a CT DICOM series (:mod:`pointforge.serve.dicom`)
whose member names, sizes and compression ratios are checked first; it is
read whole (the skull must come out of it) and then kept as it came, so that
``generate`` can write the implant back as DICOM referencing the series. The
checked file is renamed into place atomically; only then is a job written.
"""

from __future__ import annotations

import gzip
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.data.volumes import read_binary_volume
from pointforge.errors import DataError
from pointforge.serve.dicom import read_series_zip

__all__ = ["Checked", "sniff", "check_upload", "zip_members", "MAX_ZIP_RATIO", "MAX_ZIP_MEMBERS"]

MAX_ZIP_RATIO = 100  # a DICOM slice compresses perhaps 3-10×; far more is a zip bomb
MAX_ZIP_MEMBERS = 4000
SUFFIX = {"nrrd": ".nrrd", "nifti": ".nii", "nifti-gz": ".nii.gz", "dicom-zip": ".zip"}
_NAMED_FORMATS = {
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"%PDF": "a PDF document",
    b"GIF8": "a GIF image",
    b"DICM": "a single DICOM file",
}


@dataclass(frozen=True)
class Checked:
    kind: str  # nrrd, nifti, nifti-gz or dicom-zip
    suffix: str  # of the stored file
    shape: tuple[int, int, int]


def _nifti_magic(head: bytes) -> bool:
    nifti1 = len(head) >= 348 and head[344:348] == b"n+1\x00"
    nifti2 = len(head) >= 8 and head[4:8] == b"n+2\x00"
    return nifti1 or nifti2


def sniff(path: Path) -> str:
    """The upload's type from its content: nrrd, nifti, nifti-gz or dicom-zip; DataError for anything else."""
    with open(path, "rb") as handle:
        head = handle.read(1024)
    if head.startswith(b"NRRD000"):
        return "nrrd"
    if _nifti_magic(head):
        return "nifti"
    if head.startswith(b"\x1f\x8b"):
        try:
            with gzip.open(path, "rb") as handle:
                inner = handle.read(548)
        except (OSError, EOFError):
            inner = b""
        if _nifti_magic(inner):
            return "nifti-gz"
        raise DataError("the upload is gzip-compressed but holds no NIfTI image; upload a .nii.gz, .nrrd or a zip")
    if head.startswith(b"PK\x03\x04"):
        return "dicom-zip"
    if len(head) > 132 and head[128:132] == b"DICM":
        named = "a single DICOM file"
    else:
        named = next((what for magic, what in _NAMED_FORMATS.items() if head.startswith(magic)), "")
    said = f" (it is {named})" if named else ""
    raise DataError(
        f"the upload is not a NRRD, NIfTI or zipped DICOM series{said}; the file type is read from the content, "
        "not the name"
    )


def _declared_voxels(path: Path, kind: str) -> tuple[int, ...]:
    """The shape a volume's header promises, read without touching its data."""
    if kind == "nrrd":
        import nrrd

        try:
            with open(path, "rb") as handle:
                header = nrrd.read_header(handle)
        except Exception as exc:  # pynrrd raises several types for a broken header
            raise DataError(f"the NRRD header cannot be read ({type(exc).__name__}: {exc})".splitlines()[0]) from None
        if any(key.replace(" ", "") == "datafile" for key in header):
            raise DataError("the NRRD names a detached data file; upload one attached .nrrd (header and data together)")
        return tuple(int(s) for s in np.atleast_1d(header.get("sizes", [])))
    opener = gzip.open if kind == "nifti-gz" else open
    with opener(path, "rb") as handle:
        head = handle.read(540)
    if len(head) >= 348 and head[344:348] == b"n+1\x00":
        little = struct.unpack("<i", head[:4])[0] == 348
        dims = struct.unpack(("<" if little else ">") + "8h", head[40:56])
    else:
        little = struct.unpack("<i", head[:4])[0] == 540
        dims = struct.unpack(("<" if little else ">") + "8q", head[16:80])
    return tuple(int(d) for d in dims[1 : 1 + max(0, min(int(dims[0]), 7))])


def check_volume_size(shape: tuple[int, ...], max_voxels: int) -> None:
    count = int(np.prod([max(s, 0) for s in shape], dtype=np.float64)) if shape else 0
    if count > max_voxels:
        raise DataError(
            f"the volume would hold {count:,} voxels (shape {tuple(shape)}); the service takes at most {max_voxels:,}"
        )


def zip_members(path: Path, max_bytes: int) -> list[zipfile.ZipInfo]:
    """The files in a zip after the checks that come before reading any: names, count, sizes, ratios."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"the zip cannot be read ({exc}); re-create it") from None
    with archive:
        infos = [info for info in archive.infolist() if not info.is_dir()]
    if len(infos) > MAX_ZIP_MEMBERS:
        raise DataError(f"the zip holds {len(infos)} files; the service takes at most {MAX_ZIP_MEMBERS}")
    for info in infos:
        name = info.filename
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":"):
            raise DataError(f"zip member {name[:80]!r} has an absolute or '..' path; refused (nothing is extracted)")
        if info.compress_size and info.file_size / info.compress_size > MAX_ZIP_RATIO:
            raise DataError(
                f"zip member {name[:80]!r} expands {info.file_size / info.compress_size:.0f}× "
                f"(more than {MAX_ZIP_RATIO}×): refused as a zip bomb"
            )
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise DataError(f"the zip expands to {total:,} bytes; the service takes at most {max_bytes:,}")
    return infos


def check_upload(raw: Path, target: Path, *, max_voxels: int, max_unzipped: int) -> Checked:
    """Check the received file ``raw``; write the volume to ``target`` (+ the kind's suffix) atomically.

    A DataError (one line) for anything the service cannot take; ``target`` then does not exist."""
    kind = sniff(raw)
    final = target.with_name(target.name + SUFFIX[kind])
    if kind == "dicom-zip":
        series = read_series_zip(raw, zip_members(raw, max_unzipped), max_voxels=max_voxels)
        with atomic_path(final, suffix=SUFFIX[kind]) as tmp:
            shutil.copyfile(raw, tmp)
        return Checked(kind, SUFFIX[kind], series.skull.shape)
    check_volume_size(_declared_voxels(raw, kind), max_voxels)
    with atomic_path(final, suffix=SUFFIX[kind]) as tmp:
        shutil.copyfile(raw, tmp)
        try:
            volume = read_binary_volume(tmp)
        except DataError as exc:
            raise DataError(str(exc).replace(str(tmp), "the upload")) from None
    return Checked(kind, SUFFIX[kind], volume.shape)

"""A CT DICOM series uploaded as a zip → the skull (:mod:`pointforge.data.dicom` does the reading).

The zip's members were checked first (names, count, sizes, ratios:
:func:`pointforge.serve.uploads.zip_members`); here they are read into memory
one by one and never extracted, so nothing from the zip becomes a path. The
zip itself is kept as the upload: ``generate`` reads it again to write the
implant as DICOM (Segmentation, Encapsulated STL) referencing the series.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Iterator

from pointforge.data.dicom import CTSeries, ct_series_from_bytes

__all__ = ["read_series_zip"]


def _member_bytes(path: Path, members: list[zipfile.ZipInfo]) -> Iterator[bytes]:
    with zipfile.ZipFile(path) as archive:
        for info in members:
            yield archive.read(info)


def read_series_zip(path: Path, members: list[zipfile.ZipInfo], *, max_voxels: int) -> CTSeries:
    """The CT series in the zip at ``path`` (its checked ``members``): the skull, the headers, the notes."""
    return ct_series_from_bytes(_member_bytes(path, members), max_voxels)

"""Atomic writes leave files with the permissions a plain write would give."""

from __future__ import annotations

import os
import stat

import pytest

from pointforge import atomic
from pointforge.atomic import atomic_path, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_new_files_follow_the_umask_and_replaced_files_keep_their_mode(tmp_path):
    atomic_write_text(tmp_path / "report.json", "{}")
    with atomic_path(tmp_path / "implant.nrrd") as tmp:
        tmp.write_bytes(b"x")  # a library writing to the name it is given
    expected = 0o666 & ~atomic._UMASK  # 0o644 under the usual umask 022, not mkstemp's private 0o600
    assert _mode(tmp_path / "report.json") == expected and _mode(tmp_path / "implant.nrrd") == expected
    os.chmod(tmp_path / "report.json", 0o640)
    atomic_write_text(tmp_path / "report.json", '{"again": 1}')
    assert _mode(tmp_path / "report.json") == 0o640 and "again" in (tmp_path / "report.json").read_text()

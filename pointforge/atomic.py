"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A reader (a monitor, a resumed run, a crashed run's successor, a training job
reading a prepared dataset) sees either the old file or the complete new one,
never a half-written file that looks whole. Every file pointforge writes goes
through here: :func:`atomic_writer` for an open handle, :func:`atomic_path`
for libraries that want a file name (pynrrd, nibabel, laspy), and the
one-liners below.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it and put it back
    os.umask(mask)
    return mask


# Read once, at import: os.umask is process-wide and briefly changing it later
# could race with another thread creating files.
_UMASK = _umask()


def _new_file_mode(target: Path) -> int:
    """What ``open(target, "w")`` would give: the old file's mode when replacing one, else 0o666 less the umask.

    ``mkstemp`` makes its file private (0o600), so without this every output
    would be unreadable to anyone but its owner.
    """
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return 0o666 & ~_UMASK


def _fsync_dir(folder: Path) -> None:
    # The rename itself lives in the directory entry; without this a power loss
    # can forget the rename even though the file's data reached the disk.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "", durable: bool = True) -> Iterator[Path]:
    """A temporary file name next to ``path`` (ending in ``suffix``, so format-sniffing
    writers see the right extension); once the block has written it, fsync and rename
    it over ``path``. On an exception the temporary file is removed, ``path`` untouched.

    ``durable=False`` skips the fsyncs: readers still never see a partial file
    (the rename is atomic), but a power cut may lose the latest version. That
    suits status files rewritten every few seconds, not checkpoints.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    with contextlib.suppress(OSError):
        os.chmod(tmp, _new_file_mode(target))
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb", *, durable: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on success fsync and rename it over ``path``.

    On an exception the temporary file is removed and ``path`` is left untouched.
    ``durable`` as in :func:`atomic_path`.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode must be 'w' or 'wb', not {mode!r}")
    with atomic_path(path, durable=durable) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    with atomic_writer(path, "wb") as handle:
        np.save(handle, array)


def atomic_save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    with atomic_writer(path, "wb") as handle:
        np.savez(handle, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> None:
    with atomic_writer(path, "w", durable=durable) as handle:
        handle.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_writer(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", durable=durable)

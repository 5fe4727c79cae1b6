"""File locks between processes: the one place pointforge calls ``flock``.

Two uses, one primitive. A builder of shared data (a synthetic dataset, a
pair set) that many ranks may ask for at once holds :func:`exclusive_lock`
while it builds: the others wait, then find the data built. A training job
holds its run directory's lock for its whole life
(:class:`pointforge.train.run_dir_lock.RunDirLock`), taking it with
:func:`try_flock` so that a second job is refused at once instead of waiting.

``flock`` locks belong to the open file and end with the process, however
it ends, so a crash never leaves a stale lock behind; the lock file itself
stays and means nothing unless someone holds a lock on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from pointforge.errors import UserError

__all__ = ["LockUnsupported", "exclusive_lock", "try_flock", "unlock"]

# What flock's non-blocking form says when another process holds the lock.
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_POLL_S = 0.2


class LockUnsupported(UserError):
    """The filesystem does not support file locks (some network filesystems)."""


def try_flock(handle: IO[Any], *, shared: bool = False) -> bool:
    """Take a lock on ``handle`` without waiting: True if taken, False if another process holds it.

    Raises :class:`LockUnsupported` when the filesystem refuses locks altogether.
    """
    try:
        fcntl.flock(handle.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in _HELD:
            return False
        raise LockUnsupported(
            f"cannot lock {getattr(handle, 'name', handle)} ({err.strerror or err}): its filesystem does not "
            "support file locks; use a local disk or a filesystem with locking (NFS v4, Lustre)"
        ) from None
    return True


def unlock(handle: IO[Any]) -> None:
    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive_lock(
    lock_path: str | Path,
    *,
    timeout_s: float | None = None,
    on_wait: Callable[[], None] | None = None,
    on_timeout: Callable[[], BaseException] | None = None,
) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created, with its folder, if missing) for the ``with`` block.

    Waits while another process holds it, calling ``on_wait`` once when it
    has to wait. With ``timeout_s``, gives up after that long and raises what
    ``on_timeout`` returns (a :class:`TimeoutError` without one).
    """
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        started = time.monotonic()
        told = False
        while not try_flock(handle):
            if not told and on_wait is not None:
                on_wait()
            told = True
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise (
                    on_timeout() if on_timeout is not None else TimeoutError(f"waited {timeout_s:g} s for {lock_path}")
                )
            time.sleep(_POLL_S)
        try:
            yield
        finally:
            unlock(handle)

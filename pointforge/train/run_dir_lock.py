"""One writer per run directory: an OS lock that rank 0 holds for the life of a job.

Two jobs writing one run dir (a second terminal, a tmux window, a scheduler's
retry) would both write ``latest.pt``, ``metrics.jsonl`` and ``run.json`` and
interleave their histories. Rank 0 therefore takes ``RUN_DIR/train.lock``
with ``flock`` before it writes anything, and keeps it until it exits. The
kernel releases the lock when the process ends, however it ends (a crash, an
OOM kill, ``kill -9``), so no stale lock is ever left behind and there is no
lock file to delete by hand. The file itself stays and names the last holder
(pid, host, start time); only the lock on it means "in use".

On a shared filesystem (several nodes), NFS v4 and Lustre/GPFS carry flock
between machines; a filesystem without locks makes :meth:`RunDirLock.acquire`
fail with one line saying so.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from pointforge.errors import ConfigError, UserError
from pointforge.flock import LockUnsupported, try_flock, unlock
from pointforge.train.dist import DistEnv, broadcast_object

LOCK_FILE = "train.lock"

__all__ = ["LOCK_FILE", "RunDirInUse", "RunDirLock", "lock_holder", "lock_run_dir", "in_use_message"]


class RunDirInUse(ConfigError):
    """Another live process holds the run directory's lock (run.dir names a directory in use)."""


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (it has not recorded itself yet)"
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    since = holder.get("since")
    when = ""
    if isinstance(since, (int, float)):
        age = max(0.0, time.time() - since)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        when = f", training since {stamp} ({_age(age)} ago)"
    return f"pid {pid} on host {host}{when}"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def in_use_message(run_dir: str | os.PathLike, holder: dict[str, Any] | None) -> str:
    """The one line every command prints for a run dir that another job holds."""
    pid = (holder or {}).get("pid")
    stop = (
        f"stop it first (Ctrl-C in its terminal, or kill -TERM {pid}: it saves and exits)" if pid else "stop it first"
    )
    return (
        f"run dir {run_dir} is in use by {_describe(holder)}; {stop} and continue with --resume auto, "
        "or choose another run.dir"
    )


def _read_holder(handle: Any) -> dict[str, Any] | None:
    try:
        handle.seek(0)
        data = json.loads(handle.read() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RunDirLock:
    """``flock`` on ``RUN_DIR/train.lock``, exclusive and non-blocking; released by :meth:`release` or process exit."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._handle: Any = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunDirInUse` naming the holder; then record this process in the file."""
        if self._handle is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # "a+": create if missing, never truncate before the lock is ours (the holder's record stays readable).
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            taken = try_flock(handle)
        except LockUnsupported:
            handle.close()
            raise UserError(
                f"cannot lock run dir {self.run_dir}: its filesystem does not support "
                "file locks; choose a run.dir on a local disk or a filesystem with locking (NFS v4, Lustre)"
            ) from None
        if not taken:
            holder = _read_holder(handle)
            handle.close()
            raise RunDirInUse(in_use_message(self.run_dir, holder))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is None:
            return
        try:
            unlock(self._handle)
        finally:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds ``run_dir``'s lock now (``{}`` when the holder has not recorded itself yet), or None when it is free.

    Probes with a non-blocking lock that is dropped at once; never creates the run dir.
    """
    path = Path(run_dir) / LOCK_FILE
    try:
        handle = open(path, encoding="utf-8")
    except OSError:
        return None
    with handle:
        try:
            taken = try_flock(handle, shared=True)
        except LockUnsupported:
            return None
        if not taken:
            return _read_holder(handle) or {}
        unlock(handle)
    return None


def lock_run_dir(env: DistEnv, run_dir: str | os.PathLike) -> RunDirLock:
    """Rank 0 takes the run dir's lock before anything is written there; every rank learns if it could not.

    Nothing is written before this (not even ``train.log``), so a refused
    second job leaves the running job's files exactly as they were. The
    other ranks get a lock they do not hold (its release does nothing).
    """
    lock = RunDirLock(run_dir)
    refusal = None
    if env.is_main:
        try:
            lock.acquire()
        except UserError as err:
            refusal = (type(err).__name__, str(err))
    refusal = broadcast_object(env, refusal)
    if refusal is not None:
        kind, message = refusal
        raise (RunDirInUse if kind == "RunDirInUse" else UserError)(message)
    return lock

"""The job queue, kept in SQLite (the standard library's) so that a crash loses nothing.

A job is one accepted upload. Its life: ``queued`` → ``running`` → ``done`` or
``failed``; a finished case whose files were removed to keep the disk bound
becomes ``evicted``. A row is written only after its upload is complete and
checked (:mod:`pointforge.serve.uploads`), in one committed transaction, so an
accepted upload is never lost; a worker takes a job by moving it from
``queued`` to ``running`` in one statement, so no job runs twice at once.

After a crash or ``kill -9`` the jobs left ``running`` are queued again
(:meth:`JobStore.recover`); one that was already interrupted
:data:`MAX_ATTEMPTS` times is marked failed with that reason instead, so a
case that kills the server cannot keep killing it.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Job", "JobStore", "MAX_ATTEMPTS", "new_job_id", "is_job_id"]

MAX_ATTEMPTS = 2
_ID_BYTES = 8

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT NOT NULL,
    input TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    stage TEXT NOT NULL DEFAULT '',
    done INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    seconds REAL,
    bytes INTEGER NOT NULL DEFAULT 0
)
"""


def new_job_id() -> str:
    """A fresh id made by the server (16 hex digits): the only name a case ever has on disk."""
    return secrets.token_hex(_ID_BYTES)


def is_job_id(text: str) -> bool:
    return len(text) == 2 * _ID_BYTES and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Job:
    id: str
    name: str
    input: str  # the upload's file name inside the data folder's uploads/, made by the server
    kind: str  # what the upload was: nrrd, nifti, nifti-gz or dicom-zip
    status: str
    stage: str
    done: int
    total: int
    message: str
    attempts: int
    created: float
    started: float | None
    finished: float | None
    seconds: float | None
    bytes: int

    def public(self) -> dict[str, Any]:
        """What the API shows of a job (no server paths)."""
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "stage": self.stage,
            "done": self.done,
            "total": self.total,
            "message": self.message,
            "attempts": self.attempts,
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
            "seconds": self.seconds,
            "bytes": self.bytes,
        }


_COLUMNS = (
    "id, name, input, kind, status, stage, done, total, message, attempts, created, started, finished, seconds, bytes"
)


class JobStore:
    """The jobs of one data folder. Thread-safe: one connection, one lock, every change committed at once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed job survives a power cut, not only a crash
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[Job]:
        with self._lock:
            return [Job(*row) for row in self._db.execute(f"SELECT {_COLUMNS} FROM jobs {sql}", args).fetchall()]

    def _change(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def add(self, job_id: str, name: str, input_name: str, kind: str) -> Job:
        self._change(
            "INSERT INTO jobs (id, name, input, kind, status, created) VALUES (?, ?, ?, ?, 'queued', ?)",
            (job_id, name, input_name, kind, time.time()),
        )
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str) -> Job | None:
        found = self._rows("WHERE id = ?", (job_id,))
        return found[0] if found else None

    def all(self) -> list[Job]:
        """Every job, the newest first."""
        return self._rows("ORDER BY seq DESC")

    def with_status(self, *statuses: str) -> list[Job]:
        marks = ", ".join("?" * len(statuses))
        return self._rows(f"WHERE status IN ({marks}) ORDER BY seq", statuses)

    def claim(self) -> Job | None:
        """The oldest queued job, now ``running`` (and its attempt counted); None when the queue is empty."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
                if row is not None:
                    self._db.execute(
                        "UPDATE jobs SET status = 'running', attempts = attempts + 1, started = ?, "
                        "stage = 'starting', done = 0, total = 0, message = '' WHERE id = ?",
                        (time.time(), row[0]),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.get(row[0]) if row is not None else None

    def progress(self, job_id: str, stage: str, done: int, total: int) -> None:
        self._change(
            "UPDATE jobs SET stage = ?, done = ?, total = ? WHERE id = ? AND status = 'running'",
            (stage, done, total, job_id),
        )

    def finish(self, job_id: str, seconds: float, size: int) -> None:
        self._change(
            "UPDATE jobs SET status = 'done', stage = 'done', finished = ?, seconds = ?, bytes = ? WHERE id = ?",
            (time.time(), seconds, size, job_id),
        )

    def resize(self, job_id: str, size: int) -> None:
        """A done case's files grew (an STL made on request): count the new size towards the disk bound."""
        self._change("UPDATE jobs SET bytes = ? WHERE id = ? AND status = 'done'", (size, job_id))

    def fail(self, job_id: str, message: str, size: int = 0) -> None:
        self._change(
            "UPDATE jobs SET status = 'failed', finished = ?, message = ?, bytes = ? WHERE id = ?",
            (time.time(), message, size, job_id),
        )

    def evict(self, job_id: str) -> None:
        self._change(
            "UPDATE jobs SET status = 'evicted', bytes = 0, "
            "message = 'files removed to keep the finished cases within --max-disk-gb' WHERE id = ?",
            (job_id,),
        )

    def delete(self, job_id: str) -> bool:
        """Remove a job that is not running; False if it is running (or does not exist)."""
        return self._change("DELETE FROM jobs WHERE id = ? AND status != 'running'", (job_id,)) == 1

    def release_running(self) -> int:
        """On a clean stop (Ctrl-C, SIGTERM): jobs still running go back to the queue, their attempt not counted."""
        return self._change(
            "UPDATE jobs SET status = 'queued', attempts = MAX(attempts - 1, 0), stage = '', done = 0, total = 0, "
            "message = 'the server was stopped while this job ran; queued again' WHERE status = 'running'"
        )

    def recover(self) -> tuple[int, int]:
        """After a crash: jobs left ``running`` are queued again, or failed after :data:`MAX_ATTEMPTS` tries.

        Returns (requeued, failed)."""
        reason = (
            f"the server stopped {MAX_ATTEMPTS} times while running this job (a crash, kill or power loss); "
            "it is not tried again: check the server's log and upload it again"
        )
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            failed = self._db.execute(
                "UPDATE jobs SET status = 'failed', finished = ?, message = ? WHERE status = 'running' AND attempts >= ?",
                (time.time(), reason, MAX_ATTEMPTS),
            ).rowcount
            requeued = self._db.execute(
                "UPDATE jobs SET status = 'queued', stage = '', done = 0, total = 0, "
                "message = 'interrupted by a server restart; queued again' WHERE status = 'running'"
            ).rowcount
            self._db.execute("COMMIT")
        return requeued, failed

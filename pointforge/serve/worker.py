"""Worker threads: each takes the oldest queued job, runs `generate` on it, records how it ended.

A case is written by :func:`pointforge.implant.case.generate_case` into a
hidden folder renamed to ``cases/<id>`` only when complete, so a job re-run
after a crash replaces a half-written attempt and never leaves two outputs.
After every job, and after every STL made on request, the finished cases are
kept within ``--max-disk-gb``: the oldest finished ones lose their files (their
row says ``evicted``); queued and running cases are never touched.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from pointforge.errors import UserError
from pointforge.implant.case import generate_case
from pointforge.implant.models import Models
from pointforge.implant.options import GenerateOptions
from pointforge.serve.store import Job, JobStore

__all__ = ["DataLayout", "WorkerPool", "folder_bytes", "keep_within", "recount"]

log = logging.getLogger("pointforge.serve")


class DataLayout:
    """The data folder: jobs.sqlite3, tokens.sqlite3, audit.jsonl, uploads/<id>.<ext>, cases/<id>/, incoming/."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.db = self.root / "jobs.sqlite3"
        self.audit = self.root / "audit.jsonl"
        self.uploads = self.root / "uploads"
        self.cases = self.root / "cases"
        self.incoming = self.root / "incoming"
        self.plotly_js = self.cases / "plotly.min.js"  # one copy; view.html finds it at ../plotly.min.js
        for folder in (self.uploads, self.cases, self.incoming):
            folder.mkdir(parents=True, exist_ok=True)

    def case(self, job_id: str) -> Path:
        return self.cases / job_id

    def upload(self, job: Job) -> Path:
        return self.uploads / job.input

    def remove_case(self, job: Job) -> None:
        shutil.rmtree(self.case(job.id), ignore_errors=True)
        self.upload(job).unlink(missing_ok=True)

    def clear_incoming(self) -> None:
        """Uploads that were being received when the server stopped: never accepted, so removed."""
        for stale in self.incoming.iterdir():
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# Workers after each job and the app after each STL made on request evict; one at a time, so a case is
# counted and removed once.
_EVICTING = threading.Lock()


def keep_within(store: JobStore, layout: DataLayout, max_bytes: int, *, spare: str | None = None) -> list[str]:
    """Evict the oldest finished cases until the finished ones use at most ``max_bytes``; their ids.
    ``spare``: a case not to evict now (the one whose STL was just made for a download that follows)."""
    with _EVICTING:
        finished = sorted(store.with_status("done", "failed"), key=lambda job: job.finished or 0.0)
        used = sum(job.bytes for job in finished)
        evicted = []
        for job in finished:
            if used <= max_bytes:
                break
            if job.id == spare:
                continue
            layout.remove_case(job)
            store.evict(job.id)
            used -= job.bytes
            evicted.append(job.id)
        return evicted


def recount(store: JobStore, layout: DataLayout, job: Job) -> None:
    """Count a done case's files again (an STL made on request adds to them) towards ``--max-disk-gb``."""
    store.resize(job.id, folder_bytes(layout.case(job.id)) + layout.upload(job).stat().st_size)


class WorkerPool:
    """``count`` threads sharing one set of loaded models; :meth:`wake` after queueing a job."""

    def __init__(
        self,
        store: JobStore,
        layout: DataLayout,
        models: Models,
        options: GenerateOptions,
        *,
        count: int,
        max_disk_bytes: int,
    ):
        self.store, self.layout, self.models, self.options = store, layout, models, options
        self.max_disk_bytes = max_disk_bytes
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, name=f"serve-worker-{k}", daemon=True) for k in range(count)
        ]

    def start(self) -> WorkerPool:
        for thread in self._threads:
            thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            job = self.store.claim()
            if job is None:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self.run(job)

    def run(self, job: Job) -> None:
        """Generate one case; a user's error (or any other) fails this job only, with its one line."""
        start = time.perf_counter()
        out = self.layout.case(job.id)
        try:
            generate_case(
                self.layout.upload(job),
                out,
                self.models,
                self.options,
                overwrite=True,  # a re-run after a crash replaces what the first attempt left
                progress=lambda stage, done, total: self.store.progress(job.id, stage, done, total),
                title=f"{job.name}: generated implant",
                viewer_js=self.layout.plotly_js,
                preview=False,  # the page shows the 3-D view; preview.png would double a small case's time
            )
        except UserError as exc:
            self.store.fail(job.id, str(exc).replace(str(self.layout.upload(job)), "the upload"))
        except Exception as exc:  # noqa: BLE001 - one case's failure must not stop the worker
            log.exception("job %s failed", job.id)
            self.store.fail(job.id, f"internal error: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        else:
            size = folder_bytes(out) + self.layout.upload(job).stat().st_size
            self.store.finish(job.id, round(time.perf_counter() - start, 3), size)
        keep_within(self.store, self.layout, self.max_disk_bytes)

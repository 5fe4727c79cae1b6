"""Per-volume jobs run side by side, one failure a line: what ``data prepare`` and ``data cut-defects`` share.

Each job is a module-level function of ``(out, job)`` (so a process pool can send it) and a
job with a ``source`` path. A job that fails gives its one line and the others go on.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from pointforge.errors import DataError

__all__ = ["pool_size", "run_all"]

J = TypeVar("J")


def pool_size(workers: int | None, jobs: int) -> int:
    """``workers`` processes, by default one per core up to 4, never more than there are jobs."""
    return max(1, min(workers or min(os.cpu_count() or 1, 4), jobs or 1))


def _safely(work: Callable[[Path, Any], dict], doing: str, out: Path, job: J) -> tuple[J, dict | None, str | None]:
    try:
        return job, work(out, job), None
    except DataError as err:
        return job, None, str(err)
    except MemoryError:
        return job, None, f"{job.source}: out of memory while {doing}; use fewer --workers"  # type: ignore[attr-defined]
    except Exception as exc:  # one bad volume must not stop the rest; say what it was
        return job, None, f"{job.source}: {type(exc).__name__}: {exc}"  # type: ignore[attr-defined]


def run_all(
    work: Callable[[Path, Any], dict], doing: str, out: Path, todo: list[J], workers: int
) -> Iterator[tuple[J, dict | None, str | None]]:
    """Each job's ``(job, result, error line)`` as it finishes; in a process pool when ``workers`` > 1."""
    run = partial(_safely, work, doing, out)
    if workers == 1:
        yield from (run(job) for job in todo)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending = {pool.submit(run, job) for job in todo}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                yield future.result()

"""One progress bar for every command (rich), silent when output is not a terminal."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def progress_bar(description: str, total: int | None = None):
    """Yields ``advance(step=1, *, completed=None, total=None)``."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
        disable=not sys.stderr.isatty(),
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(description, total=total)

        def advance(step: int = 1, *, completed: int | None = None, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            if completed is not None:
                bar.update(task, completed=completed)
            else:
                bar.advance(task, step)

        yield advance

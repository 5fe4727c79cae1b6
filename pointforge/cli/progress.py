"""Progress for every command: live rich bars on a terminal, plain log lines otherwise.

On a terminal each bar shows what it counts, how far it is, the time spent and
the time left (rich's estimate from the pace so far). When standard error is
not a terminal (a log file, CI, a pipe), each bar instead writes a plain line
now and then (at most one per :data:`PLAIN_EVERY_S` seconds, and one when it
completes): ``generate: 3/10 cases (30%), 0:00:41 spent, ~0:01:36 left``.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

PLAIN_EVERY_S = 15.0


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclass
class _Plain:
    description: str
    total: float | None
    started: float = field(default_factory=time.monotonic)
    said_at: float | None = None  # when the last line was said (None: not yet, so the first update says one)
    finished: bool = False
    last: float = 0.0


class Bars:
    """Named bars; ``update(key, completed, total=..., description=..., detail=...)`` creates or moves one.

    ``detail`` replaces the default ``done/total`` text (e.g. ``step 1200`` for a
    bar that counts seconds of a time budget).
    """

    def __init__(self, *, plain: bool | None = None, say: Callable[[str], None] | None = None) -> None:
        self.plain = (not sys.stderr.isatty()) if plain is None else plain
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.rich = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            disable=self.plain,
            console=Console(stderr=True),
        )
        self.tasks: dict[str, TaskID] = {}
        self.plains: dict[str, _Plain] = {}

    def __enter__(self) -> Bars:
        self.rich.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rich.__exit__(*exc)

    def start(self, key: str, description: str, total: float | None = None) -> None:
        """A new bar under ``key`` (an earlier one under the same key stays as it ended)."""
        self.tasks[key] = self.rich.add_task(description, total=total, detail="")
        self.plains[key] = _Plain(description, total)

    def update(
        self,
        key: str,
        completed: float,
        *,
        total: float | None = None,
        description: str | None = None,
        detail: str | None = None,
    ) -> None:
        if key not in self.tasks:
            self.start(key, description or key, total)
        plain = self.plains[key]
        if completed < plain.last:  # the bar starts over (the next case's sampler steps): a new count
            plain.started, plain.said_at, plain.finished = time.monotonic(), None, False
            self.rich.reset(self.tasks[key])
        plain.last = completed
        plain.total = total if total is not None else plain.total
        plain.description = description or plain.description
        if detail is None:
            detail = f"{completed:g}/{plain.total:g}" if plain.total else f"{completed:g}"
        self.rich.update(
            self.tasks[key], completed=completed, total=plain.total, description=description, detail=detail
        )
        if self.plain:
            self._say_plain(plain, completed, detail)

    def _say_plain(self, plain: _Plain, completed: float, detail: str) -> None:
        now = time.monotonic()
        done = bool(plain.total) and completed >= (plain.total or 0)
        if plain.finished or (not done and plain.said_at is not None and now - plain.said_at < PLAIN_EVERY_S):
            return
        plain.said_at, plain.finished = now, done
        spent = now - plain.started
        line = f"{plain.description}: {detail}"
        if plain.total:
            line += f" ({100 * min(completed / plain.total, 1):.0f}%), {_clock(spent)} spent"
            if 0 < completed < plain.total:
                line += f", ~{_clock(spent / completed * (plain.total - completed))} left"
        self.say(line)


@contextmanager
def progress_bar(description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
    """One bar; yields ``advance(step=1, *, completed=None, total=None, detail=None)``."""
    with Bars() as bars:
        bars.start("main", description, total)
        done = [0.0]

        def advance(
            step: int = 1, *, completed: int | None = None, total: int | None = None, detail: str | None = None
        ) -> None:
            done[0] = completed if completed is not None else done[0] + step
            bars.update("main", done[0], total=total, detail=detail)

        yield advance

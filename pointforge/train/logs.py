"""The project's logger and a run's log: ``get_logger`` for every module, console and ``train.log`` for a run.

:class:`LogSetup` attaches the handlers of one run: the console (rank 0 at
INFO; other ranks warnings and errors only, with a ``[rank N]`` prefix) and,
on rank 0, ``train.log`` in the run directory (everything the console showed,
with timestamps).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "pointforge"


def get_logger(name: str | None = None) -> logging.Logger:
    """The project's logger (``pointforge`` or a child such as ``pointforge.train``)."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {self.rank}] " if self.rank else ""
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now, so a live progress bar that
    redirects stderr prints log lines above itself instead of through itself."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


class LogSetup:
    """Attach console and ``train.log`` handlers for one run; :meth:`close` removes them."""

    def __init__(self, run_dir: Path | None, rank: int, *, console: bool = True):
        self.logger = get_logger()
        self.handlers: list[logging.Handler] = []
        self._old_level = self.logger.level
        self._old_propagate = self.logger.propagate
        self.logger.setLevel(logging.INFO)
        # Our handlers print everything; propagating to the root logger as well
        # would print each line twice in programs that configure logging.
        self.logger.propagate = False
        flt = _RankFilter(rank)
        if console:
            handler: logging.Handler = _StderrHandler()
            handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
            handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
            handler.addFilter(flt)
            handler.addFilter(_not_file_only)
            self._add(handler)
        if run_dir is not None and rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
            handler.setLevel(logging.INFO)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
            handler.addFilter(flt)
            self._add(handler)

    def _add(self, handler: logging.Handler) -> None:
        self.logger.addHandler(handler)
        self.handlers.append(handler)

    def close(self) -> None:
        for handler in self.handlers:
            self.logger.removeHandler(handler)
            try:
                handler.flush()
                handler.close()
            except Exception:
                pass
        self.handlers.clear()
        self.logger.setLevel(self._old_level)
        self.logger.propagate = self._old_propagate

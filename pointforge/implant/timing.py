"""Seconds per stage: the one stopwatch the pipeline, its clean-up and its writer share."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["timed"]

T = TypeVar("T")


def timed(job: Callable[[], T]) -> tuple[T, float]:
    """``job()``'s result and the wall-clock seconds it took."""
    start = time.perf_counter()
    return job(), time.perf_counter() - start

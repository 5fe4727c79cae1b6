"""What the compiled CPU searches (:mod:`.fps_compiled`, :mod:`.three_nn_compiled`) share.

Both skip work by a distance bound taken in float64 and run independent pieces of work
on a few Python threads while their kernels release the GIL. Neither piece needs Numba.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import numpy as np

__all__ = ["rounding_margins", "run_threaded"]

T = TypeVar("T")


def rounding_margins(dtype: np.dtype) -> tuple[float, float]:
    """``(shrink, slack)`` that make a float64 lower bound safe against ``dtype``'s arithmetic.

    A squared distance formed in ``dtype`` is at least the exact one times (1 - 5 units of
    rounding), less a few subnormals; a float64 box distance errs by a few of its own units.
    A bound times ``shrink`` (8 eps, 16 units) less ``slack`` (16 × tiny) covers both with room.
    """
    info = np.finfo(dtype)
    return 1.0 - 8.0 * float(info.eps), 16.0 * float(info.tiny)


def run_threaded(run: Callable[[T], None], items: Sequence[T], threads: int) -> None:
    """``run(item)`` for every item, on up to ``threads`` threads (in order on this one when 1)."""
    workers = max(1, min(threads, len(items)))
    if workers == 1:
        for item in items:
            run(item)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, items))

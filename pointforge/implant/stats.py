"""How far to trust a mean over a few cases: percentile bootstrap intervals and the verdict they allow.

A demo or an evaluation scores a few dozen cases from a handful of skulls, so
a difference of a few hundredths in a mean DSC can be chance. The intervals
here resample the *cases* (with replacement), seeded, so a run can be
repeated: :func:`bootstrap_mean` for one method's mean, :func:`paired_difference`
for the mean of the per-case differences between two methods scored on the
same cases (paired: each resample keeps a case's two scores together, so what
the cases share, such as how hard they are, cancels). :func:`verdict` says
"beats" only when the interval of the difference excludes zero on the
better side.

With the same ``seed`` and the same number of cases every call draws the
same resamples, so the intervals of several methods on one set of cases are
computed from the same resampled case sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from pointforge.errors import ConfigError

__all__ = ["Interval", "Verdict", "bootstrap_mean", "paired_difference", "verdict", "verdict_words"]

RESAMPLES = 2000
LEVEL = 0.95

Verdict = Literal["beats", "loses to", "no clear difference from"]


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` cases and its ``level`` bootstrap interval ``[low, high]`` (all NaN when ``n`` is 0)."""

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL

    def excludes_zero(self) -> bool:
        return self.n > 0 and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "level": self.level}


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ConfigError(f"bootstrap resamples must be a positive integer, got {resamples!r}")
    if not 0 < level < 1:
        raise ConfigError(f"bootstrap level must lie between 0 and 1, got {level!r}")


def bootstrap_mean(
    values: Sequence[float] | np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL
) -> Interval:
    """The mean of ``values`` and its percentile bootstrap interval: ``resamples`` draws of ``n``
    cases with replacement (seeded), the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    their means. Values must be finite (decide first what a failed case counts as)."""
    _check(resamples, level)
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ConfigError("bootstrap_mean takes finite values only; score failed cases before resampling them")
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level)
    picks = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    means = x[picks].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    mean = float(x.mean())
    # Quantiles are interpolated in floating point: keep a constant sample's interval exactly its value.
    return Interval(mean, min(float(low), mean), max(float(high), mean), int(x.size), level)


def paired_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval:
    """The mean of ``a[i] - b[i]`` over the cases and its bootstrap interval (cases resampled, pairs kept)."""
    x, y = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ConfigError(f"paired_difference needs one value of each per case, got {x.size} and {y.size}")
    return bootstrap_mean(x - y, resamples=resamples, seed=seed, level=level)


def verdict(difference: Interval, *, lower_is_better: bool = False) -> Verdict:
    """What the interval of ``first - second`` allows one to say of the first: "beats" only when the
    interval lies wholly on the better side of zero, "loses to" when wholly on the worse side."""
    if not difference.excludes_zero():
        return "no clear difference from"
    better = difference.high < 0 if lower_is_better else difference.low > 0
    return "beats" if better else "loses to"


def verdict_words(first: str, said: Verdict, second: str, metric: str) -> str:
    """One sentence, e.g. "PCDiff beats the baseline on DSC"."""
    if said == "no clear difference from":
        return f"{first} shows no clear difference from {second} on {metric} (the interval contains 0)"
    return f"{first} {said} {second} on {metric}"

"""Seeded train/val/test splits, grouped by skull so that no skull is in two splits."""

from __future__ import annotations

import math

import numpy as np

from pointforge.errors import ConfigError

SPLITS = ("train", "val", "test")


def parse_ratios(text: str | tuple[float, ...]) -> tuple[float, float, float]:
    """'0.7,0.1,0.2' (train, val, test) → normalised tuple."""
    try:
        values = [float(v) for v in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise ConfigError(
            f"split ratios {text!r} are not numbers; write them like 0.7,0.1,0.2 (train,val,test)"
        ) from None
    if len(values) == 2:
        values = [values[0], 0.0, values[1]]
    if len(values) != 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise ConfigError(
            f"split ratios {text!r} must be 2 or 3 non-negative numbers (train,[val,]test), e.g. 0.7,0.1,0.2"
        )
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def split_skulls(skull_ids: list[str], ratios: tuple[float, float, float], seed: int) -> dict[str, str]:
    """Seeded split of skulls (not cases) so no skull is in two splits.

    Every split with a non-zero ratio gets at least one skull when there are
    enough skulls; the rest goes to train.
    """
    unique = sorted(set(skull_ids))
    n = len(unique)
    order = np.random.default_rng(seed).permutation(n)
    want_test = ratios[2] > 0
    want_val = ratios[1] > 0
    n_test = max(1 if want_test and n >= 2 else 0, int(round(ratios[2] * n)))
    n_val = max(1 if want_val and n >= 3 else 0, int(round(ratios[1] * n)))
    if n_test + n_val >= n:  # keep at least one training skull
        overflow = n_test + n_val - (n - 1)
        n_val = max(0, n_val - overflow)
        n_test = min(n_test, n - 1 - n_val)
    assignment = {}
    for rank, i in enumerate(order):
        if rank < n_test:
            assignment[unique[i]] = "test"
        elif rank < n_test + n_val:
            assignment[unique[i]] = "val"
        else:
            assignment[unique[i]] = "train"
    return assignment

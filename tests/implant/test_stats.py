"""Bootstrap intervals and the verdict they allow (pointforge.implant.stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pointforge.errors import ConfigError
from pointforge.implant.stats import Interval, bootstrap_mean, paired_difference, verdict, verdict_words


def test_constant_differences_give_a_zero_width_interval():
    diff = paired_difference([0.7, 0.5, 0.9, 0.3], [0.6, 0.4, 0.8, 0.2])
    assert diff.mean == pytest.approx(0.1)
    assert diff.low == diff.mean == diff.high and diff.n == 4


def test_a_symmetric_sample_holds_its_mean_and_the_interval_narrows_with_more_cases():
    few = bootstrap_mean([1.0, 2.0, 3.0, 4.0, 5.0])
    assert few.mean == 3.0 and few.low < 3.0 < few.high
    assert 1.0 <= few.low and few.high <= 5.0
    many = bootstrap_mean(np.tile([1.0, 2.0, 3.0, 4.0, 5.0], 20))
    assert many.high - many.low < few.high - few.low


def test_the_interval_is_a_95_percent_one():
    """On draws from N(0, 1) the interval of the mean is about ±1.96/√n wide."""
    x = np.random.default_rng(3).standard_normal(400)
    got = bootstrap_mean(x)
    half = 1.96 * x.std() / math.sqrt(x.size)
    assert (got.high - got.low) / 2 == pytest.approx(half, rel=0.1)


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    x = np.random.default_rng(1).random(25)
    assert bootstrap_mean(x, seed=4) == bootstrap_mean(x, seed=4)
    assert bootstrap_mean(x, seed=4) != bootstrap_mean(x, seed=5)


def test_pairing_cancels_what_the_cases_share():
    """Case difficulty varies a lot, the method's gain is steady: the paired interval excludes zero
    although the two methods' own intervals overlap."""
    hard = np.random.default_rng(0).random(20)
    a, b = hard + 0.05 + 0.01 * np.sin(np.arange(20)), hard
    assert bootstrap_mean(a).low < bootstrap_mean(b).high  # overlapping
    assert paired_difference(a, b).low > 0


def test_bad_inputs_are_refused_and_no_cases_give_nan():
    with pytest.raises(ConfigError, match="finite values only"):
        bootstrap_mean([0.5, float("nan")])
    with pytest.raises(ConfigError, match="one value of each per case"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ConfigError, match="resamples"):
        bootstrap_mean([1.0], resamples=0)
    empty = bootstrap_mean([])
    assert empty.n == 0 and math.isnan(empty.mean) and not empty.excludes_zero()


def test_beats_only_where_the_interval_excludes_zero_on_the_better_side():
    up, down, across = Interval(0.1, 0.02, 0.2, 20), Interval(-0.1, -0.2, -0.02, 20), Interval(0.05, -0.01, 0.1, 20)
    assert verdict(up) == "beats" and verdict(down) == "loses to" and verdict(across) == "no clear difference from"
    # HD95: lower is better, so a negative difference is the win.
    assert verdict(down, lower_is_better=True) == "beats" and verdict(up, lower_is_better=True) == "loses to"
    assert verdict(Interval(0.0, 0.0, 0.0, 20)) == "no clear difference from"  # identical scores
    assert verdict_words("PCDiff", "beats", "the baseline", "DSC") == "PCDiff beats the baseline on DSC"
    said = verdict_words("PCDiff", "no clear difference from", "the baseline", "HD95")
    assert said == "PCDiff shows no clear difference from the baseline on HD95 (the interval contains 0)"

"""Progress bars: plain lines off a terminal (throttled, one at the end, a new count when a bar starts over),
and the demo's bars (one per network while training, then one per stage)."""

from __future__ import annotations

import pytest

from pointforge.cli import progress
from pointforge.cli.demo import _StageBars


@pytest.fixture
def slow_plain(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 1e9)  # nothing but the first and the last line of a count


def test_plain_lines_say_how_far_and_the_time_left_without_flooding(slow_plain):
    said: list[str] = []
    with progress.Bars(plain=True, say=said.append) as bars:
        for done in range(1, 11):
            bars.update("cases", done, total=10, description="generate (cases)")
        assert said[0].startswith("generate (cases): 1/10 (10%), 0:00:00 spent, ~") and "left" in said[0]
        assert said[1].startswith("generate (cases): 10/10 (100%)") and len(said) == 2
        bars.update("cases", 10, total=10)  # already said
        bars.update("steps", 3, total=20, detail="step 3")
        for done in (1, 20):  # the next case's steps: a new count, said again
            bars.update("cases", done, total=20)
    assert said[2].startswith("steps: step 3 (15%)")
    assert said[3].startswith("generate (cases): 1/20 (5%)") and said[4].startswith("generate (cases): 20/20 (100%)")
    assert len(said) == 5


def test_demo_bars_one_per_network_while_training_then_per_stage(slow_plain, capsys):
    with _StageBars() as bars:
        bars.bars.plain = True
        bars("train", 1, 60, {"pcdiff": _at(3), "voxelizer": _at(None)})
        bars("train", 30, 60, {"pcdiff": _at(40), "voxelizer": _at(12)})
        bars("generate", 1, 2, "1.25 min")
        bars("train", 1, 120, {"pcdiff": _at(41), "voxelizer": _at(13)})  # the next phase
        bars("score", 2, 2, None)
        bars("probe", 1, 4, "3,000 PCDiff and 3,000 voxelizer steps")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("train pcdiff: step 3 (2%)") and err[1].startswith("train voxelizer: step … (2%)")
    assert err[2].startswith("generate test implants with the models after 1.25 min (cases): 1/2 (50%)")
    assert err[3].startswith("train pcdiff: step 41") and err[4].startswith("train voxelizer: step 13")
    assert err[5].startswith("score (cases): 2/2 (100%)")
    assert err[6].startswith(
        "probe the models after 3,000 PCDiff and 3,000 voxelizer steps on validation (cases): 1/4 (25%)"
    )
    assert len(bars.bars.tasks) == 7  # two training phases × two networks, generate, score, probe


def _at(step, until=None) -> dict:
    return {"step": step, "until": until}


def test_demo_bars_count_steps_under_a_step_budget(slow_plain, capsys):
    """With --train-steps each network's bar is its steps of its target (the phase's seconds say nothing of it)."""
    with _StageBars() as bars:
        bars.bars.plain = True
        bars("train", 30, 75, {"pcdiff": _at(500, 2500), "voxelizer": _at(None, 1500)})
        bars("train", 74, 75, {"pcdiff": _at(2500, 2500), "voxelizer": _at(1500, 1500)})
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("train pcdiff: step 500 of 2,500 (20%)")
    assert err[1].startswith("train voxelizer: step … of 1,500 (0%)")
    assert err[2].startswith("train pcdiff: step 2500 of 2,500 (100%)") and len(err) == 4

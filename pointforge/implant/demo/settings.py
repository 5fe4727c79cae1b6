"""The demo's settings, its refusals, and its first stage: the data, synthesised (or the user's) and prepared."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pointforge.atomic import atomic_write_text
from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls.splits import check_split
from pointforge.data.synthetic.dataset import FAMILIES, synthesize
from pointforge.errors import DataError, UserError
from pointforge.implant.demo import budget


@dataclass
class DemoSettings:
    """What the demo does; the defaults are `make demo`'s, sized by :mod:`.budget` to about ten minutes on 2 cores."""

    minutes: float = budget.DEFAULT_MINUTES  # training wall-clock budget; the two models train side by side
    family: str = "anatomical"  # the synthetic skull family (pointforge.data.synthetic.dataset.FAMILIES)
    skulls: int = budget.DEFAULT_SKULLS
    size: int = 64
    points: int = 16_384  # surface points per prepared volume
    split: str = budget.DEFAULT_SPLIT
    seed: int = 0
    ensemble: int = 5
    sampler: str = "dpm++2m"
    steps: int | None = 20
    phases: tuple[float, ...] = budget.PHASES  # fractions of the budget after which the models are kept and probed
    probe_cases: int = budget.PROBE_CASES  # validation cases each phase is probed on
    probe_ensemble: int = budget.PROBE_ENSEMBLE
    probe_steps: int = budget.PROBE_STEPS
    device: str = "auto"
    workers: int | None = None
    data: str | None = None  # a raw SkullBreak/SkullFix folder to use instead of synthetic skulls
    # (PCDiff, voxelizer) steps instead of minutes: the same models on any machine, whatever its load
    # (equal-budget comparisons); the phases end at the same fractions of these.
    train_steps: tuple[int, int] | None = None
    config: str = "demo"  # the packaged preset both networks train from (pcdiff/<config>.yaml, voxelizer/<config>.yaml)
    reach_mm: float | None = None  # the clean-up keeps implant voxels within this distance of the points (generate's)
    skull_points: int | None = None  # defective-skull points beside the implant points in the voxelizer (generate's)
    # The few-step student's network calls (--distill, --distill-calls): 0, no student; 1 or 2, the chosen
    # PCDiff distilled into a student of that many calls after the test stage (:mod:`.student`).
    distill: int = 0
    # The student's step budget; None: its preset's train.max_steps (pcdiff_student/<config>.yaml).
    student_steps: int | None = None

    def validate(self) -> None:
        if not self.minutes > 0:
            raise UserError(f"--minutes must be positive, got {self.minutes}")
        if self.family not in FAMILIES:
            raise UserError(f"--family {self.family!r}: no such skull family; choose one of: {', '.join(FAMILIES)}")
        if self.probe_cases < 1 or self.probe_ensemble < 1 or self.probe_steps < 1:
            raise UserError("the probe's cases, ensemble and steps must each be at least 1")
        if self.data is not None and not Path(self.data).is_dir():
            raise UserError(f"--data {self.data}: no such folder; give a raw SkullBreak or SkullFix dataset folder")
        if self.skulls < 5:
            raise UserError(f"--skulls must be at least 5 (training, validation and test skulls), got {self.skulls}")
        if self.size < 48:
            raise UserError(f"--size must be at least 48 (thinner grids lose the bone), got {self.size}")
        try:
            check_split(self.split)
        except UserError as err:
            raise UserError(f"--split: {err}") from None
        if self.train_steps is not None and (
            len(self.train_steps) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.train_steps)
        ):
            raise UserError(
                f"--train-steps must be two positive step counts (PCDiff,voxelizer), got {self.train_steps!r}"
            )
        if self.reach_mm is not None and not self.reach_mm > 0:
            raise UserError(f"--reach-mm must be a positive distance in mm, got {self.reach_mm}")
        if self.skull_points is not None and self.skull_points < 64:
            raise UserError(f"--skull-points must be at least 64, got {self.skull_points}")
        if isinstance(self.distill, bool) or self.distill not in (0, 1, 2):
            raise UserError(
                f"--distill-calls must be 1 or 2 (the student's network calls per proposal), got {self.distill!r}; "
                "or leave out --distill for no student"
            )
        if self.student_steps is not None and (isinstance(self.student_steps, bool) or self.student_steps < 1):
            raise UserError(f"the student's step budget must be a positive step count, got {self.student_steps!r}")
        if sorted(self.phases) != list(self.phases) or not self.phases or self.phases[-1] != 1.0:
            raise UserError("phases must increase and end at 1.0")


@dataclass
class DemoResult:
    out: Path
    report_md: Path
    report_html: Path
    summary: dict = field(default_factory=dict)


SETTINGS_FILE = "demo_settings.json"
# The one setting a resumed run may change: --resume --distill adds a student to a finished demo
# (its phases and test cases kept), and --resume without it finishes one without the student.
MAY_CHANGE_ON_RESUME = ("distill",)


def settings_record(s: DemoSettings) -> dict:
    """The settings as ``demo_settings.json`` holds them (what a resumed run must match)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()}


def check_out(out: Path, s: DemoSettings, *, resume: bool = False) -> None:
    """A new (or empty) ``out``; with ``resume``, the folder of an earlier run with the same settings
    (but :data:`MAY_CHANGE_ON_RESUME`; a setting the earlier run did not record had its default)."""
    if not resume:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(
                f"{out} already exists and is not empty; give a new --out (the demo never overwrites results), "
                "or --resume to finish the run that wrote it"
            )
        return
    try:
        earlier = json.loads((out / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        raise UserError(f"--resume: {out} holds no demo run ({SETTINGS_FILE} is missing); drop --resume") from None
    earlier = {**settings_record(DemoSettings()), **earlier}  # a demo older than a setting ran with its default
    now = settings_record(s)
    changed = sorted(k for k, v in now.items() if earlier.get(k) != v and k not in MAY_CHANGE_ON_RESUME)
    if changed:
        said = ", ".join(f"{k} {earlier.get(k)!r} → {now[k]!r}" for k in changed)
        raise UserError(f"--resume: {out} was run with other settings ({said}); give the same options, or a new --out")


def record_settings(out: Path, s: DemoSettings) -> None:
    atomic_write_text(out / SETTINGS_FILE, json.dumps(settings_record(s), indent=1))


def _already_prepared(prepared: Path, s: DemoSettings, log: Callable[[str], None]) -> tuple[Path, Path]:
    """A folder ``data prepare`` wrote: used as it is (its split kept), with the raw volumes it came from."""
    try:
        info = json.loads((prepared / "dataset.json").read_text())
        raw = Path(info["source_root"])
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{prepared / 'dataset.json'} is unreadable; prepare the dataset again (pointforge data prepare)"
        )
    if s.split != budget.DEFAULT_SPLIT:
        raise UserError(
            f"--data {prepared} is already prepared with its own split; drop --split or give the raw folder"
        )
    if not raw.is_dir():
        raise DataError(f"{prepared} was prepared from {raw}, which is gone; give the raw folder as --data instead")
    log(f"[1/7] using the prepared dataset {prepared} (its split; volumes from {raw})")
    return raw, prepared


def make_data(out: Path, s: DemoSettings, log: Callable[[str], None], progress) -> tuple[Path, Path]:
    """Stage 1: the raw dataset (synthetic, or the user's ``s.data``) and its prepared form under ``out/data``."""
    raw, prepared = out / "data" / "raw", out / "data" / "prepared"
    if s.data is not None and (Path(s.data) / "dataset.json").is_file():
        return _already_prepared(Path(s.data), s, log)
    if s.data is None:
        log(
            f"[1/7] synthesising {s.skulls} SkullBreak-style skulls of the {s.family} family at {s.size}³ "
            f"and preparing them → {out / 'data'}"
        )
        synthesize(raw, s.skulls, s.size, s.seed, layout="skullbreak", family=s.family)
    else:
        raw = Path(s.data)
        log(f"[1/7] preparing {raw} (split {s.split} by skull) → {prepared}")
    prep = prepare_dataset(
        raw,
        prepared,
        n_points=s.points,
        seed=s.seed,
        split=s.split,
        workers=s.workers,
        progress=(lambda d, n, _name: progress("prepare", d, n, None)) if progress else None,
    )
    if prep.failures:
        raise DataError(f"prepare failed on {raw}: " + "; ".join(prep.failures))
    return raw, prepared

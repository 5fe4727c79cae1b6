"""`pointforge demo`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.progress import TaskID


class _StageBars:
    """One rich progress bar per demo stage, created when the stage first reports."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not sys.stderr.isatty(),
            console=Console(stderr=True),
        )
        self.tasks: dict[str, TaskID] = {}
        self.current: str | None = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, stage: str, done: float, total: float, info) -> None:
        if stage != self.current or stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
            self.current = stage
        description = stage
        if stage == "train" and info:
            description = (
                "train (seconds; steps " + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None) + ")"
            )
        self.progress.update(self.tasks[stage], completed=done, total=total, description=description)


def demo(
    out: Path = typer.Option(Path("demo_out"), "--out", help="New or empty folder for everything the demo writes."),
    minutes: float = typer.Option(
        5.0, "--minutes", help="Training wall-clock budget (PCDiff and voxelizer side by side)."
    ),
    skulls: int = typer.Option(10, "--skulls", help="Synthetic skulls (5 defect cases each)."),
    size: int = typer.Option(64, "--size", help="Volume size S (S³ voxels over a 230 mm field of view)."),
    ensemble: int = typer.Option(5, "--ensemble", help="Implant proposals per case."),
    sampler: str = typer.Option("dpm++2m", "--sampler", help="ddpm, ddim or dpm++2m."),
    steps: int = typer.Option(20, "--steps", help="Sampler steps (ignored by ddpm)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    seed: int = typer.Option(0, "--seed"),
    data: Path = typer.Option(
        None,
        "--data",
        help="A raw SkullBreak or SkullFix folder (any size or spacing) "
        "to run on instead of synthetic skulls (--skulls and --size then do not apply).",
    ),
) -> None:
    """The whole system on synthetic data (or your own, --data): data → training → implants → evaluation against a baseline and an oracle → report."""
    from pointforge.implant.demo import DemoSettings, _fmt, run_demo

    settings = DemoSettings(
        minutes=minutes,
        skulls=skulls,
        size=size,
        ensemble=ensemble,
        sampler=sampler,
        steps=None if sampler == "ddpm" else steps,
        device=device,
        seed=seed,
        data=None if data is None else str(data),
    )
    with _StageBars() as bars:
        result = run_demo(out, settings, log=typer.echo, progress=bars)
    s = result.summary
    typer.echo(
        f"mean DSC on {len(s['cases'])} held-out cases: PCDiff pipeline {_fmt(s['curve'][-1]['dsc_mean'])}, "
        f"baseline {_fmt(s['baseline_dsc_mean'])} ({'beaten' if s['beats_baseline'] else 'NOT beaten'}); "
        f"total {s['timings_s']['total_s'] / 60:.1f} min"
    )
    typer.echo(f"report: {result.report_html} (and {result.report_md.name})")

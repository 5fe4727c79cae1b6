"""``pointforge doctor``: parse, call :func:`pointforge.ops.doctor.run_doctor`, print.

Register with the root app::

    from pointforge.cli import doctor as doctor_cli
    doctor_cli.register(app)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer


def doctor_command(
    overrides: Optional[List[str]] = typer.Argument(
        None, help="key=value overrides for --config, as for pointforge train."
    ),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="The training config to check (its data, run dir, workers, checkpoints)."
    ),
    task: Optional[str] = typer.Option(
        None, "--task", help="Task of --config (default: the config's run.task, or its folder name)."
    ),
    data: Optional[Path] = typer.Option(
        None, "--data", help="Dataset folder to check (default: the config's data root)."
    ),
    resume: Optional[str] = typer.Option(
        None,
        "--resume",
        help="Checkpoint to resume from, or 'auto' (the run dir's newest): readable and fits the config?",
    ),
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="A pointforge launch plan: GPUs, ports, run dirs and every job's config."
    ),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="Processes the run will use (GPUs needed, shared memory)."
    ),
    port: Optional[int] = typer.Option(
        None, "--port", min=1, max=65535, help="Rendezvous port to check (default: torchrun's 29500)."
    ),
    tmux: bool = typer.Option(False, "--tmux", help="Check that tmux is installed (for pointforge launch --tmux)."),
    run_dir: Optional[Path] = typer.Option(
        None, "--run-dir", help="Run directory to check (default: the config's run.dir)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Check Python, torch, CUDA, cuDNN, NCCL, GPUs, CUDA_VISIBLE_DEVICES, the dataset, free disk,
    /dev/shm, the rendezvous port, tmux, the run dir and a resume checkpoint. Exit status 1 on any failure."""
    from pointforge.ops.doctor import run_doctor

    report = run_doctor(
        config=config,
        task=task,
        overrides=list(overrides or []),
        data=str(data) if data else None,
        resume=resume,
        plan=plan,
        nproc=nproc,
        port=port,
        tmux=tmux,
        run_dir=run_dir,
    )
    if as_json:
        typer.echo(json.dumps([c.__dict__ for c in report.checks], indent=2))
    else:
        typer.echo(report.text())
    if report.failed:
        sys.exit(1)


def register(app: typer.Typer) -> None:
    """Add ``doctor`` to the root ``pointforge`` app."""
    app.command("doctor")(doctor_command)

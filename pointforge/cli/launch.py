"""``pointforge launch``: parse, call :mod:`pointforge.ops.launch` (plan, start, stop), print.

Register with the root app::

    from pointforge.cli import launch as launch_cli
    launch_cli.register(app)
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from pointforge.errors import ConfigError


def launch_command(
    args: Optional[List[str]] = typer.Argument(
        None, help="PLAN.yaml and/or key=value overrides applied to every job.", metavar="PLAN.yaml|KEY=VALUE"
    ),
    job: Optional[List[str]] = typer.Option(
        None,
        "--job",
        help="NAME:TASK:GPUS[:CONFIG], GPUS like 0-6, 7, 0,2 or cpu/cpu4 (repeatable; instead of a plan file).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan (GPU map, command, environment per job) and start nothing."
    ),
    tmux: bool = typer.Option(
        False, "--tmux", help="Start a tmux session: a window per job and one running pointforge monitor."
    ),
    session: Optional[str] = typer.Option(
        None, "--session", help="tmux session name (default: the plan's session, or pointforge)."
    ),
    resume: Optional[str] = typer.Option(
        None,
        "--resume",
        help="'auto' for every job (continue from its newest checkpoint), 'none', or a checkpoint path (one job only).",
    ),
    runs_dir: Optional[Path] = typer.Option(
        None,
        "--runs-dir",
        help="Where run dirs go (RUNS_DIR/NAME) for --job, and where --stop looks without a plan (default: runs).",
    ),
    stop: Optional[str] = typer.Option(
        None,
        "--stop",
        help="Stop job NAME, or all: SIGTERM to its workers, which write a checkpoint and exit.",
        metavar="NAME|all",
    ),
    now: bool = typer.Option(False, "--now", help="With --stop: end the job at once (no checkpoint)."),
    wait: float = typer.Option(
        600.0, "--wait", min=0, help="With --stop: seconds to wait for the jobs to end (0: do not wait)."
    ),
) -> None:
    """Run several training jobs on one machine, each on its own GPUs, port, run dir and environment.

    The plan is checked before anything starts; GPU numbers are physical (as
    nvidia-smi shows them) and become cuda:0..k-1 inside each job. Set
    POINTFORGE_FAKE_GPUS=N to rehearse a plan on a machine without GPUs
    (the jobs then run on the CPU).
    """
    from pointforge.ops.launch.start import launch

    spec, overrides = plan_spec(args, job, runs_dir, session)
    if stop is not None:
        _stop(spec, stop, runs_dir, now=now, wait=wait)
        return

    if spec is None:
        raise ConfigError(
            "nothing to launch; give a plan file (see pointforge/configs/launch/example.yaml) or --job NAME:TASK:GPUS[:CONFIG]"
        )
    if resume not in (None, "auto", "none") and len(spec.jobs) > 1:
        raise ConfigError(
            f"--resume {resume} names one checkpoint but the plan has {len(spec.jobs)} jobs; use --resume auto, or set resume: per job in the plan"
        )

    plan, started = launch(spec, extra_overrides=overrides, resume=resume, tmux=tmux, dry_run=dry_run)
    typer.echo(plan.text())
    if dry_run:
        typer.echo("\ndry run: nothing started")
        return
    _say_started(plan, started, spec, tmux=tmux)


def plan_spec(args, job, runs_dir, session):
    """The plan (from a plan file or --job flags, or None) and the key=value overrides among ``args``."""
    from pointforge.ops.launch.spec import PlanSpec, load_plan, parse_job_flag

    plan_file: Optional[Path] = None
    overrides: list[str] = []
    for item in args or []:
        if "=" in item:
            overrides.append(item)
        elif plan_file is None:
            plan_file = Path(item)
        else:
            raise ConfigError(f"two plan files given ({plan_file} and {item}); give one plan, or --job flags")
    spec = None
    if plan_file is not None:
        spec = load_plan(plan_file)
        if job:
            raise ConfigError("give either a plan file or --job flags, not both")
    elif job:
        spec = PlanSpec(jobs=[parse_job_flag(j) for j in job])
    if spec is not None:
        if runs_dir is not None:
            spec.runs_dir = str(runs_dir)
        if session:
            spec.session = session
    return spec, overrides


def _stop(spec, stop: str, runs_dir, *, now: bool, wait: float) -> None:
    """--stop: SIGTERM (or kill with --now) the named jobs and wait; exit 1 if one is still running."""
    from pointforge.ops.launch.spec import DEFAULT_RUNS_DIR
    from pointforge.ops.launch.stop import jobs_in, stop_jobs

    refs = jobs_in(spec, [] if spec is not None else [runs_dir or DEFAULT_RUNS_DIR])
    results = stop_jobs(refs, stop, now=now, wait_s=0.0 if now else wait, on_result=lambda r: typer.echo(r.message))
    if wait and not now:
        for result in results:
            if result.action != "not running":
                typer.echo(result.message)
    if any("still running" in r.message for r in results):
        raise typer.Exit(1)


def _say_started(plan, started, spec, *, tmux: bool) -> None:
    from pointforge.ops.runs import CONSOLE_LOG

    typer.echo("")
    for launched in started:
        where = f"pid {launched.pid}" if launched.pid else "pid not known yet"
        typer.echo(f"started {launched.name} ({launched.mode}, {where}); log {launched.run_dir / CONSOLE_LOG}")
    dirs = " ".join(str(j.run_dir) for j in plan.jobs)
    source = str(plan.source) if plan.source else f"--runs-dir {spec.runs_dir}"
    if tmux:
        typer.echo(f"attach: tmux attach -t {plan.session}")
    typer.echo(f"watch:  pointforge monitor {dirs} --watch 30")
    typer.echo(f"stop:   pointforge launch {source} --stop all   (or --stop NAME)")


def register(app: typer.Typer) -> None:
    """Add ``launch`` to the root ``pointforge`` app."""
    app.command("launch", context_settings={"allow_interspersed_args": True})(launch_command)

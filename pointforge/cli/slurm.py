"""``pointforge slurm``: parse, call :mod:`pointforge.ops.slurm` (plan, script, submit), print.

A command of its own rather than ``launch --slurm``: on a cluster the
scheduler picks nodes and GPUs, so launch's GPU numbers, ports, tmux and
``--stop`` mean nothing there, and Slurm asks for what launch never needs
(nodes, partition, account, time limit). The plan file and ``--job`` flags
are launch's, read per node.

Register with the root app::

    from pointforge.cli import slurm as slurm_cli
    slurm_cli.register(app)
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from pointforge.errors import ConfigError


def slurm_command(
    args: Optional[List[str]] = typer.Argument(
        None, help="PLAN.yaml and/or key=value overrides applied to every job.", metavar="PLAN.yaml|KEY=VALUE"
    ),
    job: Optional[List[str]] = typer.Option(
        None,
        "--job",
        help="NAME:TASK:GPUS[:CONFIG]; GPUS per node: 0-3 is four GPUs on every node, cpu2 two CPU processes.",
    ),
    nodes: int = typer.Option(1, "--nodes", "-N", min=1, help="Nodes; one torchrun agent on each."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="Slurm partition."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Slurm account to charge."),
    time_limit: Optional[str] = typer.Option(
        None, "--time", "-t", help="Time limit per allocation (MINUTES, HH:MM:SS, D-HH:MM:SS); the job requeues itself."
    ),
    signal_before: int = typer.Option(
        120, "--signal-before", min=10, help="Seconds before the time limit at which the job checkpoints and requeues."
    ),
    gres: str = typer.Option("gpu", "--gres-name", help="What the cluster calls GPUs in --gres (gpu, or gpu:a100)."),
    cpus_per_task: Optional[int] = typer.Option(
        None, "--cpus-per-task", min=1, help="CPUs per node for the agent and its workers."
    ),
    runs_dir: Optional[Path] = typer.Option(
        None, "--runs-dir", help="Where run dirs go (RUNS_DIR/NAME); must be shared by the nodes."
    ),
    allow_local: bool = typer.Option(
        False,
        "--allow-local-run-dir",
        help="Accept a run dir that is not on a known shared filesystem (every node mounts it).",
    ),
    resume: Optional[str] = typer.Option(None, "--resume", help="'auto': continue the run dir's earlier checkpoints."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the sbatch script; submit nothing."),
) -> None:
    """Submit training jobs to Slurm: one torchrun agent per node, checkpoint and requeue before the time limit."""
    from pointforge.cli.launch import plan_spec
    from pointforge.ops.slurm.submit import SlurmOptions, plan_slurm, submit

    spec, overrides = plan_spec(args, job, runs_dir, None)
    if spec is None:
        raise ConfigError("nothing to submit; give a plan file or --job NAME:TASK:GPUS[:CONFIG]")
    if resume not in (None, "auto", "none"):
        raise ConfigError(f"--resume {resume}: on Slurm a job always continues its own run dir; use --resume auto")
    if resume == "auto":
        for j in spec.jobs:
            j.resume = "auto"
    options = SlurmOptions(
        nodes=nodes,
        partition=partition,
        account=account,
        time_limit=time_limit,
        signal_before_s=signal_before,
        gres_name=gres,
        cpus_per_task=cpus_per_task,
        allow_local_run_dir=allow_local,
    )
    planned = plan_slurm(spec, options, extra_overrides=overrides, require_sbatch=not dry_run)
    for sjob in planned:
        typer.echo("\n".join(sjob.lines(nodes)))
        if dry_run:
            typer.echo("\n" + sjob.script)
            continue
        job_id = submit(sjob)
        typer.echo(f"submitted {sjob.name}: Slurm job {job_id}; output {sjob.run_dir}/slurm-{job_id}.out")
        typer.echo(
            f"  watch: pointforge monitor {sjob.run_dir}    stop with a checkpoint: scancel --batch --signal=TERM {job_id}"
        )
    if dry_run:
        typer.echo("dry run: nothing submitted")


def register(app: typer.Typer) -> None:
    """Add ``slurm`` to the root ``pointforge`` app."""
    app.command("slurm", context_settings={"allow_interspersed_args": True})(slurm_command)

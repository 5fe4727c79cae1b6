"""``pointforge monitor``: parse, call :mod:`pointforge.ops.monitor`, print.

Register with the root app::

    from pointforge.cli import monitor as monitor_cli
    monitor_cli.register(app)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer


def monitor_command(
    paths: Optional[List[Path]] = typer.Argument(None, help="Run dirs, or folders of runs (default: runs)."),
    watch: Optional[float] = typer.Option(
        None, "--watch", min=0.5, help="Redraw every SECONDS until Ctrl-C.", metavar="SECONDS"
    ),
    logs: int = typer.Option(0, "--logs", min=0, help="Also show the last N lines of each run's log.", metavar="N"),
    no_gpus: bool = typer.Option(False, "--no-gpus", help="Leave out the GPU table."),
    no_slurm: bool = typer.Option(
        False, "--no-slurm", help="Leave out the Slurm jobs (shown where Slurm is installed)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON snapshot (runs and GPUs) instead of tables."),
) -> None:
    """One table of runs: status (crashed = gone without a final status), progress, loss, LR, speed, ETA,
    last checkpoint and its age, disk used; pointforge's Slurm jobs (state, nodes, elapsed, time left, progress);
    and the GPUs with the jobs on them, where NVML or nvidia-smi tell."""
    from rich.console import Console

    from pointforge.ops import monitor as ops

    roots = list(paths or [Path("runs")])
    if watch is not None and not as_json:
        ops.watch(roots, watch, log_lines=logs, console=Console())
        return
    snap = ops.snapshot(roots, gpus=not no_gpus, slurm=not no_slurm)
    if as_json:
        typer.echo(json.dumps(snap.as_dict(), indent=2, default=str))
        return
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(ops.render(snap, log_lines=logs, width=console.width))


def register(app: typer.Typer) -> None:
    """Add ``monitor`` to the root ``pointforge`` app."""
    app.command("monitor")(monitor_command)

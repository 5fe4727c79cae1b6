"""``pointforge monitor``: one table of runs (and GPUs), read from the run directories alone.

It reads what the engine and the launcher write (``run.json``,
``metrics.jsonl``, ``train.log``, ``console.log``, ``ranks/``, ``launch.json``)
and never talks to a training process, so it works on a run that hangs, one
that crashed, and one that finished last week.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from pointforge.errors import DataError
from pointforge.formats import format_bytes, format_duration
from pointforge.ops.host import GpuInventory, format_gpu_list, gpu_inventory
from pointforge.ops.runs import CONSOLE_LOG, RunState, find_run_dirs, run_state, tail_lines
from pointforge.ops.slurm.queue import QueuedJob, queued_jobs

STATUS_STYLE = {
    "running": "green",
    "starting": "cyan",
    "restarting": "yellow",
    "finished": "blue",
    "stopped": "magenta",
    "failed": "red",
    "crashed": "bold red",
}


@dataclass
class Snapshot:
    runs: list[RunState]
    gpus: GpuInventory | None
    taken_at: float = field(default_factory=time.time)
    slurm: list[QueuedJob] = field(default_factory=list)  # pointforge's Slurm jobs, where Slurm is installed

    def as_dict(self) -> dict[str, Any]:
        gpus = None
        if self.gpus is not None:
            gpus = {
                "count": self.gpus.count,
                "source": self.gpus.source,
                "note": self.gpus.note,
                "gpus": [
                    {
                        **{k: v for k, v in g.__dict__.items() if k != "processes"},
                        "processes": [
                            {"pid": p.pid, "memory_mb": p.memory_mb, "job": job_of_pid(self.runs, p.pid)}
                            for p in g.processes
                        ],
                    }
                    for g in self.gpus.gpus
                ],
            }
        runs = [r.as_dict() for r in self.runs]
        return {"taken_at": self.taken_at, "runs": runs, "gpus": gpus, "slurm": [j.as_dict() for j in self.slurm]}


def collect_runs(paths: Sequence[str | os.PathLike], *, with_disk: bool = True) -> list[RunState]:
    """Every run at or under ``paths`` (DataError for a path that does not exist)."""
    seen: set[Path] = set()
    runs: list[RunState] = []
    now = time.time()
    for path in paths:
        root = Path(path)
        if not root.exists():
            raise DataError(f"{root}: no such folder; give a run directory or a folder of runs (default: runs)")
        for run_dir in find_run_dirs(root):
            key = run_dir.resolve()
            if key in seen:
                continue
            seen.add(key)
            state = run_state(run_dir, with_disk=with_disk, now=now)
            if state is not None:
                runs.append(state)
    return runs


def snapshot(paths: Sequence[str | os.PathLike], *, gpus: bool = True, slurm: bool = True) -> Snapshot:
    runs = collect_runs(paths)
    jobs = queued_jobs([r.run_dir for r in runs]) if slurm else []
    return Snapshot(runs, gpu_inventory(details=True) if gpus else None, slurm=jobs)


def slurm_rows(jobs: Sequence[QueuedJob], runs: Sequence[RunState]) -> list[dict[str, str]]:
    """The Slurm table: each job's state and time, with its progress read from its run dir."""
    by_dir = {str(r.run_dir.resolve()): r for r in runs}
    rows = []
    for job in jobs:
        run = by_dir.get(str(Path(job.run_dir).resolve())) if job.run_dir else None
        if run is not None and run.step is not None:
            progress = (
                f"{run.step}/{run.total_steps} ({run.status})" if run.total_steps else f"{run.step} ({run.status})"
            )
        else:
            progress = "-"
        rows.append(
            {
                "job": job.job_id,
                "name": job.name,
                "state": job.shown_state,
                "nodes": job.nodes,
                "elapsed": job.elapsed,
                "left": job.time_left,
                "progress": progress,
                "run dir": job.run_dir or "-",
            }
        )
    return rows


def job_of_pid(runs: Iterable[RunState], pid: int) -> str | None:
    """``"pcdiff rank 3"`` for a worker pid of one of ``runs``; None for a process that is not ours."""
    for run in runs:
        for worker in run.workers:
            if int(worker.get("pid", -1)) == pid:
                return f"{run.name} rank {worker.get('rank', '?')}"
        if run.job_pid == pid or run.pid == pid:
            return run.name
    return None


# --------------------------------------------------------------------------- formatting


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"


def _num(value: float | None, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def run_row(run: RunState) -> dict[str, str]:
    """One table row as text, column name → cell."""
    epoch = "-" if run.epoch is None else (f"{run.epoch}/{run.epochs}" if run.epochs else str(run.epoch))
    step = "-" if run.step is None else (f"{run.step}/{run.total_steps}" if run.total_steps else str(run.step))
    speed = "-"
    if run.it_per_s is not None:
        speed = f"{run.it_per_s:.3g} it/s"
        if run.samples_per_s is not None:
            speed += f", {run.samples_per_s:.3g} sa/s"
    checkpoint = "-"
    if run.last_checkpoint:
        checkpoint = f"{Path(run.last_checkpoint).name} ({_age(run.checkpoint_age_s)})"
    if run.gpus:
        devices = f"GPU {format_gpu_list(run.gpus)}" + (" (faked)" if run.faked_gpus else "")
    elif run.world_size:
        devices = f"{run.world_size} proc"
    else:
        devices = "-"
    return {
        "run": run.name,
        "task": run.task or "-",
        "status": run.status,
        "epoch": epoch,
        "step": step,
        "loss": _num(run.loss),
        "lr": _num(run.lr, ".3g"),
        "speed": speed,
        "ETA": format_duration(run.eta_s) if run.eta_s is not None else "-",
        "checkpoint": checkpoint,
        "disk": format_bytes(run.disk_bytes),
        "devices": devices,
        "updated": _age(run.updated_age_s),
    }


def gpu_rows(inventory: GpuInventory, runs: Sequence[RunState]) -> list[dict[str, str]]:
    rows = []
    for gpu in inventory.gpus:
        procs = []
        for proc in gpu.processes:
            owner = job_of_pid(runs, proc.pid) or "not ours"
            mem = f", {proc.memory_mb / 1024:.1f} GB" if proc.memory_mb else ""
            procs.append(f"{owner} (pid {proc.pid}{mem})")
        mem = "-"
        if gpu.memory_used_mb is not None and gpu.memory_total_mb:
            mem = f"{gpu.memory_used_mb / 1024:.1f}/{gpu.memory_total_mb / 1024:.1f} GB"
        rows.append(
            {
                "GPU": str(gpu.index),
                "name": gpu.name or "-",
                "util": "-" if gpu.utilization_pct is None else f"{gpu.utilization_pct:.0f}%",
                "memory": mem,
                "temp": "-" if gpu.temperature_c is None else f"{gpu.temperature_c:.0f}°C",
                "processes": "; ".join(procs) or "idle",
            }
        )
    return rows


# Columns kept first when the screen is narrow.
COLUMN_PRIORITY = (
    "run",
    "status",
    "step",
    "loss",
    "ETA",
    "checkpoint",
    "speed",
    "lr",
    "epoch",
    "task",
    "devices",
    "disk",
    "updated",
)


def fit_columns(rows: list[dict[str, str]], width: int | None) -> list[str]:
    """The columns to show, in table order: as many as fit ``width``, most important first."""
    if not rows:
        return []
    order = list(rows[0])
    if width is None:
        return order
    need = {c: max(len(c), *(len(r[c]) for r in rows)) + 3 for c in order}
    chosen: list[str] = []
    used = 1
    for column in COLUMN_PRIORITY:
        if column in need and (used + need[column] <= width or len(chosen) < 2):
            chosen.append(column)
            used += need[column]
    return [c for c in order if c in chosen]


def _table(title: str, rows: list[dict[str, str]]) -> Any:
    """A rich table of ``rows`` (dicts with the same keys, which name the columns)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in rows[0]:
        table.add_column(name)
    for row in rows:
        table.add_row(*row.values())
    return table


def render(snap: Snapshot, *, log_lines: int = 0, width: int | None = None) -> Any:
    """A rich renderable: the runs table, the GPU table (or why there is none), log tails.

    ``width``: the screen width; columns that do not fit are left out, least important first.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.taken_at))
    if snap.runs:
        table = Table(title=f"runs ({stamp})", title_justify="left", expand=False)
        columns = fit_columns([run_row(r) for r in snap.runs], width)
        for name in columns:
            table.add_column(
                name, no_wrap=name in ("status", "run"), justify="right" if name in ("loss", "lr", "disk") else "left"
            )
        for run in snap.runs:
            row = run_row(run)
            cells = [
                Text(row[c], style=STATUS_STYLE.get(run.status, "")) if c == "status" else Text(row[c]) for c in columns
            ]
            table.add_row(*cells)
        parts.append(table)
        for run in snap.runs:
            if run.status in ("crashed", "failed", "restarting") or run.note:
                detail = "; ".join(x for x in (run.note, run.error) if x)
                if detail:
                    parts.append(Text(f"{run.name}: {run.status}: {detail}", style=STATUS_STYLE.get(run.status, "")))
    else:
        parts.append(Text(f"no runs found ({stamp})"))
    if snap.slurm:
        parts.append(_table("Slurm jobs", slurm_rows(snap.slurm, snap.runs)))
    if snap.gpus is not None:
        if snap.gpus.has_details:
            parts.append(_table("GPUs", gpu_rows(snap.gpus, snap.runs)))
        else:
            parts.append(Text(snap.gpus.note or "no GPU information (NVML not available)"))
    if log_lines > 0:
        for run in snap.runs:
            for title, path in log_files(run):
                lines = tail_lines(path, log_lines)
                parts.append(Text(f"── {run.name}: {title} ({path})", style="bold"))
                parts.append(Text("\n".join(lines) if lines else "(empty)"))
    return Group(*parts)


def log_files(run: RunState) -> list[tuple[str, Path]]:
    """train.log, and console.log too for a run that crashed or failed (its traceback is there)."""
    files = []
    train_log = run.run_dir / "train.log"
    console = run.run_dir / CONSOLE_LOG
    if train_log.is_file():
        files.append(("train.log", train_log))
    if console.is_file() and (not files or run.status in ("crashed", "failed", "restarting")):
        files.append((CONSOLE_LOG, console))
    return files


def render_text(snap: Snapshot, *, log_lines: int = 0, width: int = 200) -> str:
    """The same view as plain text (for tests, logs and pipes)."""
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None, force_terminal=False, file=open(os.devnull, "w"))
    console.print(render(snap, log_lines=log_lines, width=width))
    text = console.export_text()
    console.file.close()
    return text


def watch(paths: Sequence[str | os.PathLike], every_s: float, *, log_lines: int = 0, console: Any = None) -> None:
    """Redraw the view every ``every_s`` seconds until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    view = lambda: render(snapshot(paths), log_lines=log_lines, width=console.width)  # noqa: E731
    with Live(view(), console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(every_s)
                live.update(view(), refresh=True)
        except KeyboardInterrupt:
            pass

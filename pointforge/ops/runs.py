"""A run directory as the ops commands see it, from files alone.

The engine writes ``run.json`` (status, pid, host, progress, last metrics,
last checkpoint), ``metrics.jsonl``, ``train.log`` and ``ranks/rank*.json``
(worker pids). ``pointforge launch`` adds ``launch.json`` (the job: name,
GPUs, port, command, environment), ``launch.sh`` (the exact command, to
re-run by hand), ``launch.pid`` (the job's torchrun pid) and ``console.log``
(everything the job printed). Nothing here talks to a training process.

Statuses: ``starting`` (launched, no progress yet), ``running``,
``restarting`` (torchrun is restarting crashed workers), ``finished``,
``stopped`` (stopped on request, with a checkpoint), ``failed`` (the engine
recorded an error), ``crashed`` (the process is gone without a final status:
killed, out of memory, a segfault, a power cut).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from pointforge.ops.host import pid_runs, this_host
from pointforge.train.records import read_run_status
from pointforge.train.torchrun import live_worker_pids, pid_alive_since, rank_records

LAUNCH_JSON = "launch.json"
LAUNCH_SH = "launch.sh"
LAUNCH_PID = "launch.pid"
CONSOLE_LOG = "console.log"
LIVE_STATUSES = ("starting", "running", "restarting")
# A job launched this recently may not have recorded its pid yet (tmux starts it asynchronously).
PID_GRACE_S = 60.0
# What a pointforge job's processes have on their command line (pid-reuse guard).
JOB_MARKERS = ("torch.distributed.run", "torchrun", LAUNCH_SH)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_launch(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``launch.json`` plus the pid from ``launch.pid`` (None when the job was not started by launch)."""
    run_dir = Path(run_dir)
    record = read_json(run_dir / LAUNCH_JSON)
    if record is None:
        return None
    try:
        record["pid"] = int((run_dir / LAUNCH_PID).read_text().strip())
    except (OSError, ValueError):
        record["pid"] = None
    return record


# The rank files are the engine's; the torchrun module reads them for both launchers.
worker_pids = rank_records
live_workers = live_worker_pids


def tail_lines(path: Path, n: int, *, max_bytes: int = 1 << 20) -> list[str]:
    """The last ``n`` lines of a text file, reading at most ``max_bytes`` from its end."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first one is probably cut
    return lines[-n:]


def last_train_metrics(run_dir: Path) -> dict[str, Any]:
    """The newest record of ``metrics.jsonl`` that holds training metrics (read from the file's end)."""
    for line in reversed(tail_lines(run_dir / "metrics.jsonl", 200, max_bytes=256 * 1024)):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "train/loss" in record:
            return record
    return {}


def _last_error_line(run_dir: Path) -> str | None:
    for line in reversed(tail_lines(run_dir / CONSOLE_LOG, 60)):
        text = line.strip()
        if text.startswith("error:") or "Error" in text.split(":", 1)[0]:
            return text[:300]
    return None


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class RunState:
    """One run, read from its directory."""

    run_dir: Path
    name: str
    status: str
    task: str | None = None
    host: str | None = None
    pid: int | None = None
    job_pid: int | None = None  # torchrun's pid, for jobs started by pointforge launch
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    it_per_s: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    last_checkpoint: str | None = None
    checkpoint_age_s: float | None = None
    updated_age_s: float | None = None
    disk_bytes: int | None = None
    world_size: int | None = None
    gpus: list[int] | None = None  # physical GPUs, for launched jobs
    port: int | None = None
    faked_gpus: bool = False
    error: str | None = None
    note: str | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "workers"}
        out["run_dir"] = str(self.run_dir)
        out["worker_pids"] = [w.get("pid") for w in self.workers]
        return out


def _float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def run_state(run_dir: str | os.PathLike, *, with_disk: bool = True, now: float | None = None) -> RunState | None:
    """The state of the run in ``run_dir``, or None when it holds neither run.json nor launch.json."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    status = read_run_status(run_dir)
    launch = read_launch(run_dir)
    if status is None and launch is None:
        return None
    state = RunState(run_dir=run_dir, name=(launch or {}).get("name") or run_dir.name, status="unknown")
    launched_at = float((launch or {}).get("launched_at") or 0.0)
    if launch:
        _read_launch_record(state, launch)
    if status is not None:
        _read_run_status(state, status, run_dir, now)
    # run.json from before this launch (a resumed run) says nothing about the new job.
    if status is not None and float(status.get("started_at") or 0.0) >= launched_at:
        _judge_running(state, status, launch)
    else:
        _judge_launched(state, launch, run_dir, now)
    if state.status == "running" and state.it_per_s and state.total_steps is not None and state.step is not None:
        state.eta_s = max(0, state.total_steps - state.step) / state.it_per_s
    checkpoint = Path(state.last_checkpoint) if state.last_checkpoint else run_dir / "checkpoints" / "latest.pt"
    try:
        state.checkpoint_age_s = max(0.0, now - checkpoint.stat().st_mtime)
        state.last_checkpoint = str(checkpoint)
    except OSError:
        pass
    if state.status in LIVE_STATUSES:
        state.workers = worker_pids(run_dir, since=launched_at)
    if with_disk:
        state.disk_bytes = dir_size(run_dir)
    return state


def _read_launch_record(state: RunState, launch: dict[str, Any]) -> None:
    state.task = launch.get("task")
    state.job_pid = launch.get("pid")
    state.gpus = launch.get("gpus")
    state.port = launch.get("port")
    state.faked_gpus = bool(launch.get("faked_gpus"))
    state.world_size = launch.get("nproc")


def _read_run_status(state: RunState, status: dict[str, Any], run_dir: Path, now: float) -> None:
    """Progress and the last metrics (metrics.csv's newest row when it is newer than run.json)."""
    state.task = status.get("task") or state.task
    state.host = status.get("host")
    state.pid = status.get("pid")
    state.epoch = status.get("epoch")
    state.epochs = status.get("epochs")
    state.step = status.get("global_step")
    state.total_steps = status.get("total_steps")
    state.world_size = status.get("world_size") or state.world_size
    state.last_checkpoint = status.get("last_checkpoint")
    state.error = status.get("error")
    if status.get("updated_at"):
        state.updated_age_s = max(0.0, now - float(status["updated_at"]))
    metrics = dict(status.get("metrics") or {})
    newest = last_train_metrics(run_dir)
    if newest and int(newest.get("step", -1)) >= int(status.get("global_step") or 0):
        metrics.update(newest)
        state.step = max(int(newest["step"]), int(state.step or 0))
    state.loss = _float(metrics.get("train/loss"))
    state.val_loss = _float(metrics.get("val_loss"))
    state.lr = _float(metrics.get("train/lr"))
    state.it_per_s = _float(metrics.get("train/it_per_s"))
    state.samples_per_s = _float(metrics.get("train/samples_per_s"))


def _job_alive(launch: dict[str, Any] | None) -> bool:
    """The launched job's torchrun is alive here (and is still that job, not a reused pid)."""
    if not launch:
        return False
    return launch.get("host") == this_host() and pid_runs(launch.get("pid"), *JOB_MARKERS)


def _judge_running(state: RunState, status: dict[str, Any], launch: dict[str, Any] | None) -> None:
    """Status from this run's own run.json: a 'running' run whose rank 0 is gone crashed (or is restarting)."""
    recorded = status.get("status") or "unknown"
    if recorded not in ("running", "starting"):
        state.status = recorded
    elif state.host and state.host != this_host():
        state.status = recorded
        state.note = f"on host {state.host}; liveness not checked from here"
    elif pid_alive_since(state.pid, status.get("started_at")):
        state.status = "running"
    elif _job_alive(launch):
        state.status = "restarting"
        state.note = "rank 0 is gone; torchrun is still up (restarting or ending the job)"
    else:
        state.status = "crashed"
        state.note = "the process is gone without a final status"


def _judge_launched(state: RunState, launch: dict[str, Any] | None, run_dir: Path, now: float) -> None:
    """Status of a job launched but without a run.json of its own yet."""
    launched_at = float((launch or {}).get("launched_at") or 0.0)
    if _job_alive(launch) or (launch and launch.get("pid") is None and now - launched_at < PID_GRACE_S):
        state.status = "starting"
    elif launch and launch.get("host") != this_host():
        state.status = "starting"
        state.note = f"launched on host {launch.get('host')}; liveness not checked from here"
    else:
        state.error = _last_error_line(run_dir) or state.error
        # An "error: ..." line is the CLI reporting a problem it understood (a config
        # or data error found while starting): a failure, not a crash.
        state.status = "failed" if (state.error or "").startswith("error:") else "crashed"
        state.note = "the job ended before training started"


def is_live(state: RunState | None) -> TypeGuard[RunState]:
    return state is not None and state.status in LIVE_STATUSES


_SKIP_DIRS = {"checkpoints", "ranks", "tb", "eval", "__pycache__", ".git"}


def find_run_dirs(root: str | os.PathLike, max_depth: int = 4) -> list[Path]:
    """Run directories at or under ``root`` (a folder holding run.json or launch.json)."""
    root = Path(root)
    found: list[Path] = []

    def visit(folder: Path, depth: int) -> None:
        if (folder / "run.json").is_file() or (folder / LAUNCH_JSON).is_file():
            found.append(folder)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(
                p for p in folder.iterdir() if p.is_dir() and p.name not in _SKIP_DIRS and not p.name.startswith(".")
            )
        except OSError:
            return
        for child in children:
            visit(child, depth + 1)

    visit(root, 0)
    return found

"""Finding launched jobs and stopping them the way the engine wants.

``stop_jobs`` sends SIGTERM to a job's worker processes (listed in
``RUN_DIR/ranks/``), which finish their step, write a checkpoint and exit 0;
``now`` kills them at once instead.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from pointforge.errors import ConfigError
from pointforge.ops.host import this_host
from pointforge.ops.launch.spec import PlanSpec, absolute, job_run_dir
from pointforge.ops.runs import LAUNCH_JSON, find_run_dirs, is_live, live_workers, read_launch, run_state
from pointforge.train.torchrun import pid_alive


@dataclass
class JobRef:
    name: str
    run_dir: Path


def jobs_in(
    spec: PlanSpec | None = None, runs_dirs: Iterable[str | os.PathLike] = (), *, cwd: str | os.PathLike | None = None
) -> list[JobRef]:
    """The launched jobs named by a plan, or found (by their launch.json) under ``runs_dirs``."""
    cwd = Path(cwd or os.getcwd()).resolve()
    refs: list[JobRef] = []
    if spec is not None:
        refs += [JobRef(job.name, job_run_dir(job, spec.runs_dir, cwd)) for job in spec.jobs]
    for root in runs_dirs:
        for run_dir in find_run_dirs(absolute(root, cwd)):
            record = read_launch(run_dir)
            if record is not None:
                refs.append(JobRef(str(record.get("name") or run_dir.name), run_dir))
    return refs


@dataclass
class StopResult:
    name: str
    run_dir: Path
    action: str  # "signalled", "killed", "not running"
    message: str
    status: str | None = None  # the run's status after waiting


def send_signal(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid``; False when the process is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_job(ref: JobRef, *, now: bool = False) -> StopResult:
    """Ask one job to stop: SIGTERM to its workers (checkpoint, exit 0); ``now`` kills it at once."""
    record = read_launch(ref.run_dir)
    state = run_state(ref.run_dir, with_disk=False)
    if record is None:
        return StopResult(
            ref.name,
            ref.run_dir,
            "not running",
            f"{ref.name}: {ref.run_dir} was not started by pointforge launch (no {LAUNCH_JSON})",
        )
    if record.get("host") != this_host():
        return StopResult(
            ref.name, ref.run_dir, "not running", f"{ref.name}: runs on host {record.get('host')}; stop it there"
        )
    if not is_live(state):
        return StopResult(
            ref.name,
            ref.run_dir,
            "not running",
            f"{ref.name}: not running ({state.status if state else 'no status'})",
            state.status if state else None,
        )
    job_pid = record.get("pid")
    workers = live_workers(ref.run_dir, since=float(record.get("launched_at") or 0.0))
    if now:
        for pid in workers:
            send_signal(pid, signal.SIGKILL)
        if job_pid and pid_alive(job_pid):
            send_signal(int(job_pid), signal.SIGTERM)
        return StopResult(
            ref.name,
            ref.run_dir,
            "killed",
            f"{ref.name}: killed {len(workers)} worker(s) and torchrun; no checkpoint was written",
        )
    if workers:
        for pid in workers:
            send_signal(pid, signal.SIGTERM)
        return StopResult(
            ref.name,
            ref.run_dir,
            "signalled",
            f"{ref.name}: asked {len(workers)} worker(s) to finish the step, write a checkpoint and exit",
        )
    if job_pid and pid_alive(job_pid):
        # No worker has registered yet: nothing to save, so end torchrun (it ends its workers).
        send_signal(int(job_pid), signal.SIGTERM)
        return StopResult(ref.name, ref.run_dir, "signalled", f"{ref.name}: had not started training yet; stopped it")
    return StopResult(ref.name, ref.run_dir, "not running", f"{ref.name}: not running")


def stop_jobs(
    refs: Sequence[JobRef],
    which: str,
    *,
    now: bool = False,
    wait_s: float = 0.0,
    on_result: Callable[[StopResult], None] | None = None,
) -> list[StopResult]:
    """Stop the job named ``which`` (or ``all``) among ``refs``; wait up to ``wait_s`` for them to end."""
    if not refs:
        raise ConfigError("no launched jobs found; give the plan file or --runs-dir where the jobs' run dirs are")
    chosen = list(refs) if which == "all" else [r for r in refs if r.name == which]
    if not chosen:
        names = ", ".join(sorted({r.name for r in refs}))
        raise ConfigError(f"no job named {which}; jobs: {names} (or all)")
    results = [stop_job(ref, now=now) for ref in chosen]
    for result in results:
        if on_result is not None:
            on_result(result)
    pending = [r for r in results if r.action != "not running"]
    end = time.monotonic() + wait_s
    while pending and time.monotonic() < end:
        time.sleep(0.2)
        still = []
        for result in pending:
            record = read_launch(result.run_dir) or {}
            if pid_alive(record.get("pid")):
                still.append(result)
                continue
            state = run_state(result.run_dir, with_disk=False)
            result.status = state.status if state else None
            if state is not None and state.status == "stopped":
                result.message = f"{result.name}: stopped at step {state.step}; checkpoint {state.last_checkpoint}"
            else:
                result.message = f"{result.name}: ended ({result.status})"
        pending = still
    for result in pending:
        result.message = f"{result.name}: still running after {wait_s:g} s (a step or checkpoint may be long); run --stop again with --now to end it at once"
    return results

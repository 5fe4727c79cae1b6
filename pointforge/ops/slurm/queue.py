"""The Slurm queue read back for ``pointforge monitor``: pointforge's jobs, their state, nodes and time.

One ``scontrol show job --oneliner`` lists every job the controller still
knows (running, pending, requeued, and ended ones for ``MinJobAge``); the
jobs shown are those named ``pointforge-*`` (as :mod:`~pointforge.ops.slurm.script`
names them) and those recorded in a run dir's ``slurm.json``. ``squeue``
shows the same states but not how often a job was requeued, which is why
``scontrol`` is asked. Where Slurm is not installed the answer is empty.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

JOB_PREFIX = "pointforge-"
RECORD_NAME = "slurm.json"  # what submit writes into the run dir


@dataclass
class QueuedJob:
    """One Slurm job as the controller reports it."""

    job_id: str
    name: str
    state: str  # PENDING, RUNNING, REQUEUED, PREEMPTED, TIMEOUT, COMPLETED, CANCELLED, FAILED, ...
    reason: str
    restarts: int
    nodes: str  # the node count, and the node list once running
    elapsed: str
    time_left: str
    run_dir: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def shown_state(self) -> str:
        """The state in words, a requeued job's count and a pending job's reason included."""
        state = self.state.lower()
        if self.restarts and state in ("pending", "running", "requeued"):
            state += f" (requeued {self.restarts}×)"
        if self.state == "PENDING" and self.reason not in ("", "None"):
            state += f": {self.reason}"
        return state


def _seconds(text: str) -> int | None:
    """Slurm's ``[D-]HH:MM:SS`` (or ``MM:SS``) as seconds; None for UNLIMITED and the like."""
    days, _, clock = text.rpartition("-")
    try:
        total = int(days) * 86400 if days else 0
        parts = [int(p) for p in clock.split(":")]
    except ValueError:
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + part
    return total + seconds


def _clock(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def parse_jobs(text: str) -> list[QueuedJob]:
    """``scontrol show job --oneliner`` output, one job a line (pure: tested without Slurm)."""
    jobs = []
    for line in text.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "JobId" not in fields:
            continue
        run_time, limit = fields.get("RunTime", ""), fields.get("TimeLimit", "")
        used, allowed = _seconds(run_time), _seconds(limit)
        left = _clock(max(allowed - used, 0)) if used is not None and allowed is not None else limit.lower() or "-"
        node_list = fields.get("NodeList", "(null)")
        nodes = fields.get("NumNodes", "?") + ("" if node_list in ("(null)", "") else f" {node_list}")
        jobs.append(
            QueuedJob(
                job_id=fields["JobId"],
                name=fields.get("JobName", ""),
                state=fields.get("JobState", "UNKNOWN"),
                reason=fields.get("Reason", ""),
                restarts=int(fields.get("Restarts", "0") or 0),
                nodes=nodes,
                elapsed=run_time or "-",
                time_left=left,
                run_dir=fields.get("WorkDir", ""),
            )
        )
    return jobs


def recorded_job_ids(run_dirs: Iterable[Path]) -> set[str]:
    """The job ids ``pointforge slurm`` recorded in these run dirs."""
    found = set()
    for run_dir in run_dirs:
        try:
            found.add(str(json.loads((Path(run_dir) / RECORD_NAME).read_text())["job_id"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def queued_jobs(run_dirs: Iterable[Path] = ()) -> list[QueuedJob]:
    """pointforge's jobs the controller knows, and those recorded in ``run_dirs``; [] without Slurm."""
    if shutil.which("scontrol") is None:
        return []
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "--oneliner"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    wanted = recorded_job_ids(run_dirs)
    return [j for j in parse_jobs(done.stdout) if j.name.startswith(JOB_PREFIX) or j.job_id in wanted]

"""Starting a checked launch plan: each job detached, or in a tmux window of its own.

The exact command and environment of each job are written to
``RUN_DIR/launch.sh`` (the script the job runs; re-run it by hand to restart
the job the same way) and ``RUN_DIR/launch.json`` (read by ``monitor`` and
``--stop``); the job's torchrun pid goes to ``RUN_DIR/launch.pid``.

Jobs run detached (a process session of their own, so closing the terminal
does not end them) or, with ``--tmux``, in a tmux session with a window per job
and one running ``pointforge monitor``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pointforge.atomic import atomic_write_json, atomic_write_text
from pointforge.errors import ConfigError
from pointforge.ops.launch.plan import JobPlan, LaunchPlan, build_plan
from pointforge.ops.launch.spec import STRIPPED, STRIPPED_PREFIXES, PlanSpec
from pointforge.ops.launch.stop import send_signal
from pointforge.ops.runs import CONSOLE_LOG, LAUNCH_JSON, LAUNCH_PID, LAUNCH_SH, read_launch
from pointforge.train.torchrun import pid_alive


def job_script(job: JobPlan, cwd: Path) -> str:
    """The bash script a job runs: its own environment, then ``exec torchrun`` (same pid)."""
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        f"# pointforge launch: job {job.name}. Run it again to start the job the same way",
        "# (add --resume auto to the command once the run dir holds checkpoints).",
        f"cd {q(str(cwd))} || exit 1",
        "unset " + " ".join(STRIPPED),
        "for name in $(compgen -e); do case $name in "
        + "|".join(f"{p}*" for p in STRIPPED_PREFIXES)
        + ') unset "$name";; esac; done',
    ]
    lines += [f"export {k}={q(v)}" for k, v in job.env_set.items()]
    run_dir = q(str(job.run_dir))
    lines += [
        f"mkdir -p {run_dir}",
        # Written before exec, so it is torchrun's pid; renamed into place, so never half-written.
        f"echo $$ > {run_dir}/.{LAUNCH_PID}.tmp && mv -f {run_dir}/.{LAUNCH_PID}.tmp {run_dir}/{LAUNCH_PID}",
        # In a terminal (tmux) show the output and keep it; detached, the launcher already sends it to the log.
        f"if [ -t 1 ]; then exec > >(tee -a {run_dir}/{CONSOLE_LOG}) 2>&1; fi",
        "exec " + shlex.join(job.command),
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Started:
    name: str
    run_dir: Path
    pid: int | None
    mode: str


def _tmux(args: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", *args], env=dict(env), capture_output=True, text=True, timeout=30)


def tmux_session_exists(session: str, env: Mapping[str, str] | None = None) -> bool:
    if shutil.which("tmux") is None:
        return False
    return _tmux(["has-session", "-t", f"={session}"], env or os.environ).returncode == 0


def start_plan(plan: LaunchPlan, *, tmux: bool = False, monitor_every: float = 10.0) -> list[Started]:
    """Start every job of a checked plan (detached, or in a tmux session); return where each runs.

    Raises the plan's problems before starting anything. If a job fails to
    start, the ones already started are stopped again.
    """
    plan.check()
    base = dict(os.environ)
    if tmux:
        _check_tmux(plan, base)
    started: list[Started] = []
    try:
        for index, job in enumerate(plan.jobs):
            script, with_pid = _write_job_files(plan, job, tmux)
            if tmux:
                started.append(_start_in_tmux(plan, job, index, script, base))
            else:
                started.append(_start_detached(plan, job, script, with_pid, base))
        if tmux:
            _open_monitor_window(plan, base, monitor_every)
            for item in started:
                item.pid = wait_for_pid(item.run_dir, timeout_s=30)
    except BaseException:
        for item in started:
            pid = item.pid or wait_for_pid(item.run_dir, timeout_s=2)
            if pid and pid_alive(pid):
                send_signal(pid, signal.SIGTERM)
        raise
    return started


def _check_tmux(plan: LaunchPlan, base: dict[str, str]) -> None:
    if shutil.which("tmux") is None:
        raise ConfigError(
            "--tmux: tmux is not installed; install it (e.g. apt-get install tmux) or leave out --tmux to run the jobs detached"
        )
    if tmux_session_exists(plan.session, base):
        raise ConfigError(
            f"--tmux: a tmux session named {plan.session} already exists; close it (tmux kill-session -t {plan.session}) or pass --session NAME"
        )


def _write_job_files(plan: LaunchPlan, job: JobPlan, tmux: bool) -> tuple[Path, Path]:
    """The job's launch script and launch record in its run dir; the pid file path (cleared)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    script = job.run_dir / LAUNCH_SH
    atomic_write_text(script, job_script(job, plan.cwd))
    script.chmod(0o755)
    with_pid = job.run_dir / LAUNCH_PID
    with_pid.unlink(missing_ok=True)
    mode = "tmux" if tmux else "detached"
    atomic_write_json(
        job.run_dir / LAUNCH_JSON,
        job.record(mode=mode, session=plan.session if tmux else None, plan=plan.source, faked=plan.faked),
    )
    return script, with_pid


def _start_in_tmux(plan: LaunchPlan, job: JobPlan, index: int, script: Path, base: dict[str, str]) -> Started:
    window = ["-n", job.name, "-c", str(plan.cwd), f"bash {shlex.quote(str(script))}"]
    first = ["new-session", "-d", "-s", plan.session] if index == 0 else ["new-window", "-d", "-t", f"={plan.session}:"]
    # In one tmux command, so the window cannot end before it is told to stay open.
    result = _tmux(
        [
            *first,
            *window,
            ";",
            "set-window-option",
            "-t",
            f"={plan.session}:{job.name}",
            "remain-on-exit",
            "on",
        ],
        base,
    )
    if result.returncode != 0:
        raise ConfigError(f"tmux could not start job {job.name}: {result.stderr.strip() or result.stdout.strip()}")
    return Started(job.name, job.run_dir, None, "tmux")


def _start_detached(plan: LaunchPlan, job: JobPlan, script: Path, with_pid: Path, base: dict[str, str]) -> Started:
    with open(job.run_dir / CONSOLE_LOG, "ab") as log:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=str(plan.cwd),
            env=base,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # The script records the same pid (it execs torchrun); writing it now
    # leaves no moment in which the job looks gone.
    atomic_write_text(with_pid, f"{proc.pid}\n", durable=False)
    return Started(job.name, job.run_dir, proc.pid, "detached")


def _open_monitor_window(plan: LaunchPlan, base: dict[str, str], monitor_every: float) -> None:
    dirs = " ".join(shlex.quote(str(j.run_dir)) for j in plan.jobs)
    # The pointforge program (`-m pointforge`), as the jobs' workers run it: ops names no command module.
    monitor = (
        f"env PYTHONPATH={shlex.quote(plan.jobs[0].env_set['PYTHONPATH'])} {shlex.quote(sys.executable)} "
        f"-m pointforge monitor {dirs} --watch {monitor_every:g}"
    )
    result = _tmux(
        [
            "new-window",
            "-d",
            "-t",
            f"={plan.session}:",
            "-n",
            "monitor",
            "-c",
            str(plan.cwd),
            monitor,
            ";",
            "set-window-option",
            "-t",
            f"={plan.session}:monitor",
            "remain-on-exit",
            "on",
        ],
        base,
    )
    if result.returncode != 0:
        raise ConfigError(f"tmux could not open the monitor window: {result.stderr.strip()}")


def wait_for_pid(run_dir: Path, timeout_s: float) -> int | None:
    end = time.monotonic() + timeout_s
    while True:
        record = read_launch(run_dir)
        if record and record.get("pid"):
            return int(record["pid"])
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def launch(
    spec: PlanSpec,
    *,
    extra_overrides: Sequence[str] = (),
    resume: str | None = None,
    tmux: bool = False,
    dry_run: bool = False,
) -> tuple[LaunchPlan, list[Started]]:
    """Plan, check and (unless ``dry_run``) start the jobs of ``spec``."""
    plan = build_plan(spec, extra_overrides=extra_overrides, resume=resume)
    if dry_run:
        plan.check()
        return plan, []
    return plan, start_plan(plan, tmux=tmux)

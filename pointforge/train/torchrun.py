"""The one torchrun module: how pointforge starts, and finds, its worker processes.

``pointforge train --nproc N`` (:func:`run_torchrun`, below), ``pointforge
launch`` (:mod:`pointforge.ops.launch`, one job per GPU set) and the demo
(:func:`start_torchrun`, two jobs side by side) start ``torchrun`` through
these functions: the worker arguments
(:func:`worker_args`), the torchrun command line (:func:`torchrun_command`:
``--standalone`` with a free port per job, or a given ``c10d`` endpoint), the
``PYTHONPATH`` that makes the workers import this checkout
(:func:`worker_pythonpath`), and the worker processes read back from the rank
files the engine writes (:func:`live_worker_pids`). No launcher of our own:
each rank runs the ``pointforge`` program itself, ``python -m pointforge
train ...``. Multi-node jobs call torchrun directly (see docs/training.md).

Why the program, and not a module the caller names: the worker is whatever
``pointforge train`` does, the same for every caller (``train --nproc``,
``pointforge launch``, the demo, a benchmark), so naming it is this module's
job; and naming it by the program (``-m pointforge``, with this interpreter:
no ``PATH`` lookup, no console script needed) keeps the train layer from
naming a module of the command layer above it, as ``torchrun --no-python
pointforge`` would do from a shell.

Stopping ``train --nproc``: a terminal's Ctrl-C or a scheduler's SIGTERM
reaches this process; it forwards SIGTERM to the worker processes named in
``<run dir>/ranks/`` (not to torchrun, which would treat it as a failure),
the workers finish their step, save and exit 0, and torchrun then exits 0
too. A second signal is passed to torchrun itself, which ends the workers at
once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import pointforge
from pointforge.atomic import atomic_write_json
from pointforge.train.dist import DistEnv
from pointforge.train.preflight import check_run_dir_lock

# What torchrun runs with -m on each rank: the pointforge program (pointforge/__main__.py).
WORKER_MODULE = "pointforge"


def package_root() -> str:
    """The folder holding this ``pointforge`` package (put first on the workers' PYTHONPATH)."""
    return str(Path(pointforge.__file__).resolve().parent.parent)


def worker_args(
    task: str,
    *,
    config: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    wandb: bool = False,
) -> list[str]:
    """The ``train`` command line every rank runs (``--resume`` last, where a re-run edits it)."""
    args = ["train", task]
    if config is not None:
        args += ["--config", str(config)]
    if wandb:
        args.append("--wandb")
    args += [str(o) for o in overrides]
    if resume:
        args += ["--resume", str(resume)]
    return args


def torchrun_command(
    worker: Sequence[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    endpoint: str | None = None,
    run_id: str | None = None,
    nnodes: int | str = 1,
) -> list[str]:
    """``python -m torch.distributed.run ... -m pointforge WORKER...`` on this node.

    Without ``endpoint``: ``--standalone`` (torchrun picks a free port, so two
    jobs on one node do not collide). With one (``HOST:PORT``): a ``c10d``
    rendezvous there, named ``run_id``, for ``nnodes`` agents (one per node;
    a string where a batch script fills the number in), as ``pointforge
    launch`` plans it.
    """
    if endpoint is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id or 'pointforge'}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        WORKER_MODULE,
        *worker,
    ]


def worker_pythonpath(current: str | None) -> str:
    """``current`` with this checkout first (once), so workers import the same pointforge."""
    root = package_root()
    parts = [p for p in (current or "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *parts])


def worker_environment(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = worker_pythonpath(env.get("PYTHONPATH"))
    return env


# --------------------------------------------------------------------------- worker processes


def write_rank_record(run_dir: str | os.PathLike, env: DistEnv) -> None:
    """This rank's ``ranks/rank<N>.json``: who and where it is, read back by :func:`rank_records`."""
    atomic_write_json(
        Path(run_dir) / "ranks" / f"rank{env.rank}.json",
        {
            "pid": os.getpid(),
            "host": env.host,
            "rank": env.rank,
            "local_rank": env.local_rank,
            "world_size": env.world_size,
            "device": str(env.device),
            "restart_count": env.restart_count,
            "started_at": time.time(),
        },
    )


def rank_records(run_dir: str | os.PathLike, since: float = 0.0) -> list[dict[str, Any]]:
    """The ``ranks/rank*.json`` records (written by each rank at start-up) on this host, at or after ``since``.

    Older records are left by an earlier job in the same run dir; their pids may be reused.
    """
    host = socket.gethostname()
    found = []
    for path in sorted(Path(run_dir, "ranks").glob("rank*.json")):
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or info.get("host") != host or float(info.get("started_at", 0)) < since:
            continue
        found.append(info)
    return found


def live_worker_pids(run_dir: str | os.PathLike, since: float = 0.0) -> list[int]:
    """The pids of this host's workers of the run in ``run_dir`` that are still the processes that recorded themselves."""
    return [
        int(w["pid"])
        for w in rank_records(run_dir, since)
        if pid_alive_since(int(w.get("pid", 0)), w.get("started_at"))
    ]


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists on this machine and has not exited (a zombie counts as gone)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process, but it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): os.kill is all we have
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


_BOOT_TIME: float | None = None


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; None where unknown."""
    global _BOOT_TIME
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if _BOOT_TIME is None:
            for line in Path("/proc/stat").read_text().splitlines():
                if line.startswith("btime "):
                    _BOOT_TIME = float(line.split()[1])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    if _BOOT_TIME is None:
        return None
    # Field 22 of stat is the start time in clock ticks after boot; fields[0] is field 3.
    return _BOOT_TIME + int(fields[19]) / ticks


def pid_alive_since(pid: int | None, recorded_at: float | None, *, slack_s: float = 2.0) -> bool:
    """``pid`` is alive and is the process that recorded itself at ``recorded_at``.

    A run's recorded pid may, long after the run died, belong to an unrelated
    process; that one started later than the record was written.
    """
    if not pid_alive(pid):
        return False
    if recorded_at is None:
        return True
    started = process_start_time(int(pid))  # type: ignore[arg-type]
    return started is None or started <= float(recorded_at) + slack_s


# --------------------------------------------------------------------------- starting torchrun


def start_torchrun(
    worker: Sequence[str], *, nproc: int, max_restarts: int = 0, log: str | os.PathLike | None = None
) -> subprocess.Popen:
    """Start torchrun (``--standalone``) with ``nproc`` workers and return at once; the caller waits.

    It runs in a process session of its own, so a terminal's Ctrl-C reaches
    only the caller, which decides who gets which signal. With ``log``, its
    output and its workers' are appended to that file, unbuffered.
    """
    cmd = torchrun_command(worker, nproc=nproc, max_restarts=max_restarts)
    env = worker_environment(os.environ)
    if log is None:
        return subprocess.Popen(cmd, env=env, start_new_session=True)
    env["PYTHONUNBUFFERED"] = "1"  # a file is block-buffered: the log should grow as the run goes
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


# --------------------------------------------------------------------------- train --nproc


def run_torchrun(worker: Sequence[str], *, nproc: int, max_restarts: int, run_dir: str | os.PathLike) -> int:
    """Run torchrun with ``nproc`` workers; return its exit status (0 after a graceful stop).

    A run dir whose lock another job holds is refused here, before torchrun
    starts (rank 0 would refuse it too, a few seconds later).
    """
    run_dir = Path(run_dir)
    check_run_dir_lock(run_dir).raise_if_failed()
    started = time.time()
    proc = start_torchrun(worker, nproc=nproc, max_restarts=max_restarts)
    signals_seen = 0

    def relay(signum: int, _frame) -> None:
        nonlocal signals_seen
        signals_seen += 1
        pids = live_worker_pids(run_dir, started)
        if signals_seen == 1 and pids:
            print(
                f"pointforge: {signal.Signals(signum).name} received; asking {len(pids)} worker(s) to finish the step, "
                "save and stop (send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            _signal_all(pids, signal.SIGTERM)
            return
        # Second signal, or no workers yet: stop now. Workers live in sessions of
        # their own, so they are killed by pid; torchrun then ends by itself.
        print("pointforge: stopping now", file=sys.stderr, flush=True)
        _signal_all(pids, signal.SIGKILL)
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            # We are leaving abnormally: let torchrun take its workers down with it.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _signal_all(live_worker_pids(run_dir, started), signal.SIGKILL)
                proc.kill()
                proc.wait()


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

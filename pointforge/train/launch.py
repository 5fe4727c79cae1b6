"""``pointforge train --nproc N``: start torchrun for you on this node.

No launcher of our own: this builds a plain ``torchrun --standalone`` command
(a free rendezvous port per job, so two jobs on one node do not collide) that
runs ``python -m pointforge.cli.train train ...`` on each rank, and relays
stop signals. Multi-node jobs call torchrun directly (see docs/training.md).

Stopping: a terminal's Ctrl-C or a scheduler's SIGTERM reaches this process;
it forwards SIGTERM to the worker processes named in ``<run dir>/ranks/``
(not to torchrun, which would treat it as a failure), the workers finish
their step, save and exit 0, and torchrun then exits 0 too. A second signal
is passed to torchrun itself, which ends the workers at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pointforge


def package_root() -> str:
    return str(Path(pointforge.__file__).resolve().parent.parent)


def torchrun_command(worker_args: Sequence[str], *, nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "-m", "pointforge.cli.train", *worker_args,
    ]


def worker_environment() -> dict[str, str]:
    env = dict(os.environ)
    root = package_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    return env


def _local_worker_pids(run_dir: Path, since: float) -> list[int]:
    import socket

    host = socket.gethostname()
    pids = []
    for path in sorted((run_dir / "ranks").glob("rank*.json")):
        try:
            info = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if float(info.get("started_at", 0)) < since:
            continue  # left by an earlier job in this run dir; its pid may be reused
        pid = int(info.get("pid", 0))
        if info.get("host") != host or pid <= 0:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b"pointforge"  # no /proc (macOS): trust the file
        if b"pointforge" in cmdline:
            pids.append(pid)
    return pids


def launch(worker_args: Sequence[str], *, nproc: int, max_restarts: int, run_dir: str | os.PathLike) -> int:
    """Run torchrun with ``nproc`` workers; return its exit status (0 after a graceful stop)."""
    run_dir = Path(run_dir)
    cmd = torchrun_command(worker_args, nproc=nproc, max_restarts=max_restarts)
    # A session of its own: the terminal's Ctrl-C reaches only us, and we decide
    # who gets which signal.
    started = time.time()
    proc = subprocess.Popen(cmd, env=worker_environment(), start_new_session=True)
    signals_seen = 0

    def relay(signum: int, _frame) -> None:
        nonlocal signals_seen
        signals_seen += 1
        pids = _local_worker_pids(run_dir, started)
        if signals_seen == 1 and pids:
            print(f"pointforge: {signal.Signals(signum).name} received; asking {len(pids)} worker(s) to finish the step, "
                  "save and stop (send it again to stop at once)", file=sys.stderr, flush=True)
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
                _signal_all(_local_worker_pids(run_dir, started), signal.SIGKILL)
                proc.kill()
                proc.wait()


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

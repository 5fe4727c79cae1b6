"""Shared bits of the benchmarks: the machine's name, a table, a JSON record, this process's memory,
and the one alternation harness (:func:`alternate`, :func:`fresh_process`, :func:`checkouts`).

The harness is how a bench compares variants that must not share a process (two checkouts,
eager against compiled, two solvers whose peak memory is each one's own): each measurement
is a fresh process, the variants take turns round after round, the order flipping each
round, so a burst of other load on a shared machine falls on all of them alike; the figure
is a median over the rounds. ``--against DIR`` (e.g. ``git worktree add /tmp/base main``)
makes the variants this checkout and ``DIR``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, Union

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent  # this checkout
RESULTS_DIR = BENCH_DIR / "results"


def machine() -> str:
    """One line naming the CPU, core count, OS and Python, for every report."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def record_header(benchmark: str, *, device: str, bf16: bool, threads: int, load: dict[str, Any]) -> dict[str, Any]:
    """The fields every PVCNN2 bench's JSON record starts with: what ran, when, where and on what."""
    from datetime import datetime, timezone

    import torch

    return {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "device": device,
        "bf16": bf16,
        "threads": threads,
        "load_average": load,
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_json(name: str, record: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` atomically and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    target = RESULTS_DIR / f"{name}.json"
    handle, temporary = tempfile.mkstemp(dir=RESULTS_DIR, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(record, stream, indent=2)
            stream.write("\n")
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise
    return target


def proc_status_mb(field: str) -> float | None:
    """``VmRSS`` or ``VmHWM`` of this process from /proc, in MiB (None where there is no /proc)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart this process's resident high-water mark (Linux ``clear_refs`` 5); False where that is not possible.

    ``ru_maxrss`` cannot be reset, and Linux keeps it across fork and exec, so
    a stage measured after a bigger one (or in a child of a big driver) needs this.
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- the alternation harness


def checkouts(against: Path | None) -> list[tuple[str, Path]]:
    """The variants of an ``--against`` comparison: ``("this checkout", ROOT)``, then the other
    checkout named by its resolved path (this checkout alone without one)."""
    trees = [("this checkout", ROOT)]
    if against is not None:
        trees.append((str(against.resolve()), against.resolve()))
    return trees


def fresh_process(script: str | Path, args: Sequence[str], tree: Path = ROOT, *, check: bool = True) -> dict[str, Any]:
    """One measurement in a fresh process: ``python SCRIPT ARGS`` in ``tree``, importing ``pointforge``
    from ``tree`` (and the bench helpers from this bench/); the record it printed last as a JSON line.

    A process that fails or prints no record ends the bench with its stderr's tail (``check``), or
    gives ``{"error": its last stderr line}`` for the caller to report (``check=False``).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(BENCH_DIR)])}
    done = subprocess.run([sys.executable, str(script), *args], env=env, cwd=tree, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        if check:
            raise SystemExit(f"{Path(script).name}: the measurement in {tree} failed:\n{done.stderr[-3000:]}")
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(lines[-1])


Key = Union[str, Callable[[dict[str, Any]], float]]


@dataclass
class Alternation:
    """What :func:`alternate` measured: per variant one record per round, and the
    1-minute load average after each round."""

    runs: dict[str, list[dict[str, Any]]]
    loads: list[float]

    def median(self, name: str, key: Key) -> float:
        """The median over ``name``'s rounds of ``record[key]`` (or of ``key(record)``)."""
        pick = key if callable(key) else (lambda record: record[key])
        return statistics.median(pick(record) for record in self.runs[name])


def alternate(
    names: Sequence[str], rounds: int, measure: Callable[[int, int], dict[str, Any]], *, label: str = ""
) -> Alternation:
    """``measure(i, r)`` for every variant ``i`` of ``names`` in every round ``r``, the variants in
    turn and the order flipping each round (module docs); the load average is printed and kept
    after each round, ``label`` before it."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    loads: list[float] = []
    for r in range(rounds):
        for i in range(len(names)) if r % 2 == 0 else reversed(range(len(names))):
            runs[names[i]].append(measure(i, r))
        loads.append(os.getloadavg()[0])
        print(f"{label}round {r + 1}/{rounds} done, load average {loads[-1]:.1f}", flush=True)
    return Alternation(runs, loads)

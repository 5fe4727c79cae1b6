"""Shared bits of the benchmarks: the machine's name, a table, a JSON record, this process's memory."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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

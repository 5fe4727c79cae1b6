"""Shared helpers for benchmarks: the machine, a plain table, JSON results.

Every benchmark prints a table and writes ``bench/results/<name>.json`` with
the machine it ran on, so numbers are never separated from their context.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (CPU, cores, load, torch, GPU)."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = str(torch.__version__)
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("%x"))
        return True
    except ValueError:
        return False


def save(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` (atomically) with the machine description added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload}
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path

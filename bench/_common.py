"""What every benchmark needs: the machine in words, a printed table, a JSON file."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """The machine and software a measurement was taken on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1) if memory else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_line(info: dict | None = None) -> str:
    info = info or machine()
    parts = [f"{info['cpu']} ({info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB)"]
    parts.append(f"torch {info['torch']}, {info['torch_threads']} threads")
    if info.get("cuda"):
        parts.append(info["cuda"])
    return "; ".join(parts)


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as an aligned table; columns are (key, header); a missing value prints as '-'."""

    def cell(row, key):
        value = row.get(key)
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    table = [[header for _, header in columns]] + [[cell(r, key) for key, _ in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for n, line in enumerate(table):
        print("  ".join(text.rjust(width) for text, width in zip(line, widths)))
        if n == 0:
            print("  ".join("-" * width for width in widths))


def write_json(name: str, payload: dict) -> Path:
    """Write bench/results/<name>.json atomically and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path

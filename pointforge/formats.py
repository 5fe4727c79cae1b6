"""Values made plain for JSON files and people: one NaN policy, one byte format, one per-row report.

In the lowest layer so that every writer of JSON (the engine's metrics, the
evaluation tables, the implant reports, the benchmarks) and every printer of
sizes and durations (doctor, monitor, ``ckpt inspect``, the training log line) can share them.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pointforge.atomic import atomic_write_text

__all__ = ["json_safe", "format_bytes", "format_duration", "summary_stats", "write_rows_report"]


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data: NaN and ±inf as null, tuples as lists, paths as strings, NumPy/torch scalars as numbers.

    JSON has no NaN, and an undefined number (an empty mask's HD95, a diverged
    loss) must still be written and read back by any JSON reader; null is the
    one spelling every reader understands. An object with a ``__json__()``
    method is written as what that returns.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic) or (hasattr(value, "item") and getattr(value, "ndim", None) == 0):
        return json_safe(value.item())
    to_json = getattr(value, "__json__", None)
    if callable(to_json):
        return json_safe(to_json())
    return value


def format_bytes(n: float | None) -> str:
    """``1536`` → ``"1.5 KB"`` (powers of 1024); ``None`` → ``"-"``."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def format_duration(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` from an hour up; ``?`` for a negative or unknown duration."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def summary_stats(values) -> dict:
    """n, mean, median, std, min and max of the finite values (None and NaN skipped; all NaN when none is left)."""
    finite = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return {"n": 0, "mean": math.nan, "median": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    return {
        "n": int(finite.size),
        "mean": float(finite.mean()),
        "median": float(np.median(finite)),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
    }


def write_rows_report(out_dir, stem: str, rows: list[dict], fields: list[str], payload: dict) -> dict[str, Path]:
    """``out_dir/<stem>.csv`` (``rows`` by ``fields``) and ``<stem>.json`` (``payload``, through :func:`json_safe`), each atomic."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    paths = {"csv": out_dir / f"{stem}.csv", "json": out_dir / f"{stem}.json"}
    atomic_write_text(paths["csv"], buffer.getvalue())
    atomic_write_text(paths["json"], json.dumps(json_safe(payload), indent=1))
    return paths

"""A run's records on disk, written by rank 0: metric files, TensorBoard, W&B and ``run.json``.

Files in the run directory:

``metrics.jsonl``   one JSON object per logged step / evaluation
``metrics.csv``     the same in long form: time, step, epoch, name, value
``tb/``             TensorBoard event files
``wandb_id.txt``    the W&B run id, so a resumed run continues the same W&B run
``run.json``        the run's current state (status, pid, host, task, epoch/step,
                    last metrics, last checkpoint), rewritten atomically, so a
                    monitor can read it at any time without talking to the process

The log itself (``train.log``) is :mod:`pointforge.train.logs`'s; the engine
part that decides what is written when is
:class:`~pointforge.train.metrics_logger.MetricsLogger`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

from pointforge.atomic import atomic_write_json, atomic_write_text
from pointforge.errors import ConfigError


def _scalar(value: Any) -> float | None:
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None
    return number


class MetricsWriter:
    """Scalars to metrics.jsonl, metrics.csv, TensorBoard and (when asked) W&B. Rank 0 only."""

    def __init__(self, run_dir: Path, log_cfg: Any, *, config: Mapping[str, Any], run_name: str, resume: bool):
        self.run_dir = run_dir
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._csv_file: io.TextIOBase | None = None
        self._csv: Any = None
        if log_cfg.csv:
            path = run_dir / "metrics.csv"
            fresh = not path.exists() or path.stat().st_size == 0
            self._csv_file = open(path, "a", encoding="utf-8", newline="")
            self._csv = csv.writer(self._csv_file)
            if fresh:
                self._csv.writerow(["time", "step", "epoch", "name", "value"])
        self._tb = None
        if log_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        self._wandb = None
        if log_cfg.wandb:
            self._wandb = start_wandb(run_dir, log_cfg, config=config, run_name=run_name, resume=resume)

    def write(self, step: int, epoch: float, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
        now = time.time()
        clean = {f"{prefix}{k}": v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        record = {
            "time": round(now, 3),
            "step": step,
            "epoch": round(epoch, 4),
            **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()},
        }
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._csv is not None:
            for name, value in clean.items():
                self._csv.writerow([f"{now:.3f}", step, f"{epoch:.4f}", name, repr(value)])
            self._csv_file.flush()  # type: ignore[union-attr]  # opened together with _csv
        if self._tb is not None:
            for name, value in clean.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log({**clean, "epoch": epoch}, step=step)

    def close(self, *, failed: bool = False) -> None:
        self._jsonl.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=1 if failed else 0)
            except Exception:
                pass


def start_wandb(run_dir: Path, log_cfg: Any, *, config: Mapping[str, Any], run_name: str, resume: bool) -> Any:
    """Start a W&B run, imported only now; WANDB_MODE=offline works as W&B documents."""
    try:
        import wandb  # noqa: PLC0415 - optional dependency, imported only when asked for
    except ImportError:
        raise ConfigError(
            "W&B logging was asked for (--wandb or log.wandb=true) but the wandb package is not installed; "
            "pip install wandb, or drop --wandb"
        ) from None
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.exists() else None
    run = wandb.init(
        project=log_cfg.wandb_project,
        entity=log_cfg.wandb_entity,
        name=run_name,
        dir=str(run_dir),
        config=dict(config),
        id=run_id,
        resume="allow" if run_id else None,
    )
    if run_id is None and getattr(run, "id", None):
        atomic_write_text(id_file, str(run.id))
    return run


class RunStatus:
    """``run.json``: the run's state for monitors, rewritten atomically on every change."""

    def __init__(self, path: Path, **fixed: Any):
        self.path = path
        self.data: dict[str, Any] = {
            "status": "starting",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "updated_at": time.time(),
            **fixed,
        }
        self._written_at = 0.0

    # Progress-only updates are written at most this often; a monitor does not
    # need more, and fast steps would otherwise pay for the file on every log.
    min_interval_s = 1.0

    def update(self, *, progress_only: bool = False, **changes: Any) -> None:
        self.data.update(changes)
        now = time.time()
        if progress_only and now - self._written_at < self.min_interval_s:
            return
        self.data["updated_at"] = now
        self._written_at = now
        # Atomic for readers, but not worth an fsync each time (checkpoints,
        # which matter after a crash, get one).
        atomic_write_json(self.path, self.data, durable=False)


def read_run_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(run_dir) / "run.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None

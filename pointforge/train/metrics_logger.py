"""The engine part that reports a run: what the step measured, when it is logged, where it goes.

Every rank holds a :class:`MetricsLogger`: its :class:`MetricWindow` is what
the training step reports into, and ``last`` (the latest value of every
metric) is what a checkpoint carries. Only rank 0 opens the records
(:meth:`MetricsLogger.open`): ``config.yaml``, ``run.json``
(:class:`~pointforge.train.records.RunStatus`), ``metrics.jsonl`` with
TensorBoard and W&B (:class:`~pointforge.train.records.MetricsWriter`) and
the :class:`ProgressBar`; on the other ranks the writing methods do nothing.
The files themselves are :mod:`pointforge.train.records`'s, the log
:mod:`pointforge.train.logs`'s.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any, Mapping

from pointforge import __version__
from pointforge.config.coercion import to_dict
from pointforge.config.loader import save_yaml
from pointforge.config.training import TrainConfig
from pointforge.formats import format_duration, json_safe
from pointforge.train.dist import DistEnv
from pointforge.train.logs import get_logger
from pointforge.train.records import MetricsWriter, RunStatus
from pointforge.train.schedule import BatchPlan
from pointforge.train.state import MetricWindow, TrainState

log = get_logger("train")


def jsonable_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The numeric entries of ``metrics`` as JSON values (the project's one NaN policy: null)."""
    out = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        out[name] = json_safe(number)
    return out


class ProgressBar:
    """A live bar (loss, LR, it/s, ETA) when stderr is a terminal; nothing otherwise.

    The same numbers always reach the log every ``log.every_steps`` steps, so a
    batch job's log shows progress without a bar.
    """

    def __init__(self, mode: str, total_steps: int, start_step: int):
        self.enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self._progress = None
        self._task = None
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress as RichProgress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

    def update(self, step: int, info: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsLogger:
    """What a run reports, and where: rank 0's records, every rank's metric window and latest metrics."""

    def __init__(self, env: DistEnv, cfg: TrainConfig, run_dir: Path, task_name: str):
        self.env = env
        self.cfg = cfg
        self.run_dir = run_dir
        self.task_name = task_name
        self.window = MetricWindow()
        self.last: dict[str, float] = {}
        self.status: RunStatus | None = None
        self.writer: MetricsWriter | None = None
        self.progress: ProgressBar | None = None

    def open(
        self,
        *,
        state: TrainState,
        total_steps: int,
        steps_per_epoch: int,
        resumed_from: Path | None,
        last_checkpoint: Path | None,
    ) -> None:
        """Rank 0's config copy, ``run.json``, metrics writers and progress bar."""
        cfg, env = self.cfg, self.env
        save_yaml(cfg, self.run_dir / "config.yaml")
        self.status = RunStatus(
            self.run_dir / "run.json",
            task=self.task_name,
            run_dir=str(self.run_dir),
            world_size=env.world_size,
            restarts=env.restart_count,
            pointforge_version=__version__,
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            epochs=cfg.train.epochs,
        )
        self.status.update(
            status="running",
            epoch=state.epoch,
            global_step=state.global_step,
            resumed_from=str(resumed_from) if resumed_from else None,
            last_checkpoint=str(last_checkpoint) if last_checkpoint else None,
            error=None,
        )
        self.writer = MetricsWriter(
            self.run_dir,
            cfg.log,
            config=to_dict(cfg),
            run_name=f"{self.task_name}:{self.run_dir.name}",
            resume=resumed_from is not None,
        )
        self.progress = ProgressBar(cfg.log.progress, total_steps, state.global_step)

    def update_status(self, *, progress_only: bool = False, **changes: Any) -> None:
        """``run.json`` (rank 0, once opened; elsewhere nothing)."""
        if self.status is not None:
            self.status.update(progress_only=progress_only, **changes)

    def log_window(
        self, *, epoch: int, n_steps: int, state: TrainState, batch: BatchPlan, total_steps: int, lr: float
    ) -> None:
        """The log line for the steps since the last one (rank 0); every rank starts a new window."""
        window = self.window
        if not self.env.is_main or window.steps == 0 or self.writer is None:
            window.reset(lr)
            return
        metrics = window.summary(
            global_batch=batch.global_batch, accumulation=batch.accumulation, skipped_steps=state.skipped_steps
        )
        it_s = metrics["it_per_s"]
        eta = (total_steps - state.global_step) / it_s if it_s and math.isfinite(it_s) and it_s > 0 else float("nan")
        epoch_pos = epoch + state.step_in_epoch / max(1, n_steps)
        self.writer.write(state.global_step, epoch_pos, metrics, prefix="train/")
        self.last.update({f"train/{k}": v for k, v in metrics.items()})
        line = (
            f"epoch {epoch} step {state.global_step}/{total_steps}  loss {metrics['loss']:.4g}  lr {metrics['lr']:.3g}  "
            f"{it_s:.2f} it/s  eta {format_duration(eta)}"
        )
        if self.progress is not None and self.progress.enabled:
            self.progress.update(
                state.global_step, f"loss {metrics['loss']:.4g} lr {metrics['lr']:.3g} {it_s:.2f} it/s"
            )
        log.info(line)
        self.update_status(
            progress_only=True, epoch=epoch, global_step=state.global_step, metrics=jsonable_metrics(self.last)
        )
        window.reset(lr)

    def record_eval(self, *, global_step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """An epoch's evaluation metrics, in every record (rank 0)."""
        if not self.env.is_main or not metrics or self.writer is None:
            return
        self.writer.write(global_step, float(epoch + 1), metrics)
        self.last.update(metrics)
        log.info(f"epoch {epoch} evaluation: " + "  ".join(f"{k} {v:.5g}" for k, v in metrics.items()))
        self.update_status(metrics=jsonable_metrics(self.last))

    def close(self, *, failed: bool) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close(failed=failed)

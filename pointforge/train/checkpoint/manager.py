"""The engine's checkpoint manager: what a run saves, where, and how it resumes.

:class:`CheckpointManager` is the part of the trainer that owns a run's
checkpoints (the file format and retention are
:mod:`pointforge.train.checkpoint.format`'s): choosing the checkpoint to resume from
(rank 0 decides, every rank learns), restoring the :class:`Trainables`, the
progress and the random streams from it, and saving them. Saving gathers
every rank's RNG state (a collective, so every rank calls :meth:`save`);
the file itself is rank-0 work inside ``rank0_section``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from pointforge.config.coercion import to_dict
from pointforge.config.training import TrainConfig
from pointforge.errors import CheckpointError, ConfigError, UserError
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.data import derive_seed, seed_everything
from pointforge.train.dist import DistEnv, all_gather_objects, broadcast_object, rank0_section, report
from pointforge.train.ema import EMA
from pointforge.train.logs import get_logger
from pointforge.train.metrics_logger import MetricsLogger, jsonable_metrics
from pointforge.train.preflight import WARNING, check_existing_checkpoints, check_resume_point
from pointforge.train.schedule import restore_scheduler
from pointforge.train.state import TrainState

log = get_logger("train")


@dataclass
class Trainables:
    """What steps together and is saved together: the bare model, its optimizer, schedule, scaler and EMA."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    ema: EMA | None


class CheckpointManager:
    """A run's checkpoints: which one to resume from, restoring it, and saving new ones."""

    def __init__(self, task_name: str, cfg: TrainConfig, env: DistEnv, run_dir: Path, resume: str | None):
        self.task_name = task_name
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir
        self.resume_arg = resume
        self.files = ckpt_io.CheckpointFiles(run_dir, cfg.ckpt.keep_last)
        self.last_checkpoint: Path | None = None
        self.last_saved_step: int | None = None
        self.last_save_time = time.monotonic()
        self.resumed_from: Path | None = None
        self._picked: dict[str, Any] | None = None

    # ------------------------------------------------------------------ resume

    def _pick(self) -> dict[str, Any]:
        """Rank 0's decision, shared with every rank: which checkpoint (or an error)."""
        arg = self.resume_arg
        try:
            if arg is None:
                fresh = check_existing_checkpoints(self.run_dir, None)
                if not fresh.ok:
                    return {"error": (fresh.error.__name__, fresh.problem)}
                return {"path": None}
            if arg == "auto":
                found = ckpt_io.find_resume_checkpoint(self.run_dir, warn=log.warning)
                if found is None:
                    log.info(f"no checkpoint in {self.run_dir / 'checkpoints'}; starting from scratch")
                    return {"path": None}
                self._picked = found[1]
                return {"path": str(found[0])}
            self._picked = ckpt_io.load_checkpoint(arg)
            return {"path": arg}
        except UserError as err:
            return {"error": (type(err).__name__, str(err))}

    def load_resume_point(self) -> tuple[Path, Mapping[str, Any]] | None:
        """The checkpoint this run continues from, loaded and checked on every rank; None for a fresh start."""
        env = self.env
        decision = self._pick() if env.is_main else None
        decision = broadcast_object(env, decision)
        if "error" in decision:
            kind, message = decision["error"]
            raise (CheckpointError if kind == "CheckpointError" else ConfigError)(message)
        if decision["path"] is None:
            return None
        path = Path(decision["path"])
        # Rank 0 already holds the file it validated; the others read it now
        # (on several nodes the run dir must be on a shared filesystem).
        state = self._picked if self._picked is not None else ckpt_io.load_checkpoint(path)
        self._picked = None
        if not ckpt_io.is_pointforge_checkpoint(state):
            raise CheckpointError(
                f"{path} is not a pointforge training checkpoint; to start from its weights, import it with pointforge ckpt remap"
            )
        if state.get("task") != self.task_name:
            raise CheckpointError(
                f"checkpoint {path} was written by task '{state.get('task')}', not '{self.task_name}'"
            )
        return path, state

    def resume(
        self,
        parts: Trainables,
        progress: TrainState,
        metrics: MetricsLogger,
        *,
        peak_lr: float,
        global_batch: int,
        steps_per_epoch: int,
        total_steps: int,
    ) -> None:
        """Continue from the checkpoint the run asks for, if any; one with nothing left to train is refused."""
        point = self.load_resume_point()
        if point is None:
            return
        path, ckpt = point
        metrics.last = self.restore(
            ckpt,
            path,
            parts,
            progress,
            peak_lr=peak_lr,
            global_batch=global_batch,
            steps_per_epoch=steps_per_epoch,
        )
        cfg = self.cfg
        finding = check_resume_point(
            path,
            epoch=progress.epoch,
            global_step=progress.global_step,
            epochs=cfg.train.epochs,
            max_steps=cfg.train.max_steps,
            total_steps=total_steps,
        )
        finding.raise_if_failed()
        if self.env.is_main:
            # One exactly at the config's length finishes at once, and says so: that is what the config asks for.
            if finding.status == WARNING:
                log.warning(finding.problem)
            log.info(
                f"resumed from {path} at epoch {progress.epoch}, step {progress.global_step} "
                f"(step {progress.step_in_epoch} of the epoch)"
            )

    def restore(
        self,
        ckpt: Mapping[str, Any],
        path: Path,
        parts: Trainables,
        progress: TrainState,
        *,
        peak_lr: float,
        global_batch: int,
        steps_per_epoch: int,
    ) -> dict[str, float]:
        """Load ``ckpt`` into ``parts`` and ``progress``, and this rank's random streams; return its metrics."""
        cfg, env = self.cfg, self.env
        old_cfg = ckpt.get("config") or {}
        changed = config_changes(old_cfg, to_dict(cfg))
        if changed and env.is_main:
            log.warning(
                "config differs from the checkpoint's: " + "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
            )
        self._restore_weights(ckpt, path, parts, old_cfg)
        progress.load_state_dict(ckpt.get("progress") or {})  # before the schedule, which may read its clock
        restore_scheduler(parts.scheduler, ckpt["scheduler"], [peak_lr] * len(parts.optimizer.param_groups))
        if parts.scaler is not None and ckpt.get("scaler"):
            parts.scaler.load_state_dict(ckpt["scaler"])
        old_batch = progress.rebatch(global_batch, env.world_size, steps_per_epoch)
        if old_batch is not None and env.is_main:
            log.warning(
                f"data.global_batch changed from {old_batch} to {global_batch}; resuming epoch {progress.epoch} at step {progress.step_in_epoch}"
            )
        self._restore_rng(ckpt.get("rng") or {}, progress)
        self.last_saved_step = progress.global_step
        self.last_checkpoint = path
        self.resumed_from = path
        return dict(ckpt.get("metrics") or {})

    def _restore_weights(self, ckpt: Mapping[str, Any], path: Path, parts: Trainables, old_cfg: Mapping) -> None:
        cfg = self.cfg
        ckpt_io.load_model_state(parts.model, ckpt["model"])
        if parts.ema is not None:
            if ckpt.get("ema") is not None:
                parts.ema.load_state_dict(ckpt["ema"])
            else:
                parts.ema = EMA(parts.model, cfg.train.ema_decay or 0.0)
        old_optimizer = (old_cfg.get("optim") or {}).get("name", cfg.optim.name)
        if old_optimizer == cfg.optim.name:
            try:
                parts.optimizer.load_state_dict(ckpt["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise CheckpointError(
                    f"the optimizer state in {path} does not fit this model ({ckpt_io._short(err)}); check the task config"
                ) from None
        elif self.env.is_main:
            log.warning(
                f"optim.name changed from {old_optimizer} to {cfg.optim.name}; starting the optimizer state afresh"
            )

    def _restore_rng(self, rng: Mapping[str, Any], progress: TrainState) -> None:
        env = self.env
        if rng.get("world_size") == env.world_size and len(rng.get("per_rank") or []) == env.world_size:
            ckpt_io.restore_rng(rng["per_rank"][env.rank], env.device)
            return
        seed_everything(derive_seed(self.cfg.train.seed, "rank", env.rank, "resume", progress.global_step))
        if env.is_main:
            log.warning(
                f"checkpoint was written by {rng.get('world_size')} rank(s), this run has {env.world_size}: "
                "weights, optimizer and schedule continue exactly, random streams are re-seeded"
            )

    # ------------------------------------------------------------------ save

    def _content(self, parts: Trainables, progress: TrainState, rngs: list[Any], metrics: Mapping) -> dict[str, Any]:
        return {
            "task": self.task_name,
            "config": to_dict(self.cfg),
            "model": ckpt_io.model_state(parts.model),
            "ema": parts.ema.state_dict() if parts.ema is not None else None,
            "optimizer": ckpt_io.to_cpu(parts.optimizer.state_dict()),
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
            "progress": progress.state_dict(),
            "rng": {"world_size": self.env.world_size, "per_rank": rngs},
            "metrics": jsonable_metrics(metrics),
        }

    def save(
        self,
        parts: Trainables,
        progress: TrainState,
        metrics: MetricsLogger,
        device: torch.device,
        *,
        end_of_epoch: bool,
        eval_metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Write ``latest`` (and at an epoch's end the periodic copy and a new ``best``); every rank calls this."""
        env, cfg, state = self.env, self.cfg, progress
        report(env, "gathering RNG states for a checkpoint", epoch=state.epoch, step=state.global_step)
        rngs = all_gather_objects(env, ckpt_io.capture_rng(device))
        # Every rank holds the same (gathered or broadcast) evaluation metrics,
        # so every rank records the same best and carries the same progress.
        improved = end_of_epoch and state.best.offer(
            eval_metrics or {}, state.global_step, warn=log.warning if env.is_main else None
        )

        def write() -> str:
            path = self.files.write_latest(self._content(parts, progress, rngs, metrics.last))
            if end_of_epoch and cfg.ckpt.every_epochs and state.epoch % cfg.ckpt.every_epochs == 0:
                self.files.copy_to(path, self.files.periodic(state.epoch))
                self.files.prune()
            if improved:
                self.files.copy_to(path, self.files.best)
                log.info(f"new best {state.best.metric} {state.best.value:.5g} at step {state.global_step}")
            metrics.update_status(
                last_checkpoint=str(path), epoch=state.epoch, global_step=state.global_step, best=state.best.summary()
            )
            return str(path)

        path = rank0_section(env, "saving a checkpoint", write, timeout_s=cfg.dist.rank0_timeout_s)
        self.last_checkpoint = Path(path) if path else None
        self.last_saved_step = state.global_step
        self.last_save_time = time.monotonic()

    def due_by_time(self) -> bool:
        """``ckpt.every_minutes`` has passed since the last save (rank 0's clock decides for every rank)."""
        every = self.cfg.ckpt.every_minutes
        return self.env.is_main and every > 0 and time.monotonic() - self.last_save_time >= every * 60


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``key: old → new`` for every setting that differs (``run.dir`` aside), nested keys dotted."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changes += config_changes(a, b, name + ".")
        elif a != b and name != "run.dir":
            changes.append(f"{name}: {a!r} → {b!r}")
    return changes

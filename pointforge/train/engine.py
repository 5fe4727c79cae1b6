"""The training engine: one loop for every task, from one CPU to many GPUs.

Entry point: :func:`train` (``--dry-run``'s :func:`dry_run_plan` lives in
:mod:`pointforge.train.plan`). The trainer is assembled from parts with their
own state: :class:`~pointforge.train.state.TrainState` (progress and best
metric, saved as a checkpoint's ``progress``), a
:class:`~pointforge.train.state.MetricWindow` per log line, the run plan, and
the optimizer, scheduler, scaler and EMA.

What a step does, on every rank, in lockstep:

1. ``accumulation`` micro-batches: forward under autocast, ``loss / accumulation``
   backward; DDP's ``no_sync`` on all but the last, so gradients are reduced once.
2. One small all-reduce of ``[loss, non-finite?, stop requested?, checkpoint due?]``.
   Every decision that could otherwise differ between ranks (skip this step,
   stop, save) is taken from that shared vector, so no rank can take a path
   the others do not.
3. Unless the loss was non-finite somewhere: unscale, clip, optimizer step,
   EMA update. The scheduler advances either way.

Before each epoch the ranks compare their step counts (a mismatch fails at
once, naming ranks and counts); after it they compare the steps they ran.
Evaluation and checkpoint writing are rank-0 work in ``rank0_section``; the
other ranks never wait for them inside a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from pointforge import __version__
from pointforge.atomic import atomic_write_json
from pointforge.config import TrainConfig, save_yaml, to_dict
from pointforge.errors import CheckpointError, ConfigError, DeviceError, UserError
from pointforge.formats import json_safe
from pointforge.train import checkpoint as ckpt_io
from pointforge.train.data import (
    EpochBatches,
    build_loader,
    derive_seed,
    eval_shard,
    global_batches,
    move_to_device,
    seed_everything,
    shutdown_loader,
    worker_errors,
)
from pointforge.train.dist import (
    DistEnv,
    DistributedFailure,
    all_gather_objects,
    all_reduce_sum,
    broadcast_object,
    check_equal,
    failure_message,
    init_distributed,
    rank0_section,
    report,
    shutdown_distributed,
    stop_signals,
)
from pointforge.train.ema import EMA
from pointforge.train.lock import RunDirInUse, RunDirLock
from pointforge.train.plan import RunPlan, best_rule, dry_run_plan, make_plan
from pointforge.train.preflight import (
    FAILURE,
    WARNING,
    Finding,
    check_datasets,
    check_disk,
    check_existing_checkpoints,
    check_memory,
    check_resume_point,
)
from pointforge.train.schedule import build_optimizer, build_scheduler, restore_scheduler
from pointforge.train.state import BestMetric, MetricWindow, TrainState
from pointforge.train.task import EvalContext, StepContext, Task, split_step_output
from pointforge.train.tracking import LogSetup, MetricsWriter, Progress, RunStatus, format_duration, get_logger

__all__ = ["train", "dry_run_plan", "RunPlan", "TrainResult", "TrainingDiverged"]

log = get_logger("train")


class TrainingDiverged(RuntimeError):
    """The loss was non-finite for ``train.max_nonfinite`` steps in a row."""


@dataclass
class TrainResult:
    status: str  # "finished" or "stopped"
    run_dir: Path
    epoch: int
    global_step: int
    checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)
    best: dict[str, Any] | None = None
    signal: str | None = None
    resumed_from: Path | None = None


# --------------------------------------------------------------------------- entry point


def train(
    task: Task,
    cfg: TrainConfig,
    *,
    resume: str | os.PathLike | None = None,
    wandb: bool | None = None,
    console: bool = True,
) -> TrainResult:
    """Train ``task`` (an instance: ``pointforge.tasks.get_task(name)`` finds one by name) with ``cfg``
    on this process's share of the job.

    Works the same in one process and under torchrun (one call per rank).
    ``resume``: ``None`` (start fresh; refuses a run dir that already holds
    checkpoints), ``"auto"`` (the newest loadable checkpoint in the run dir, or
    a fresh start if there is none) or a checkpoint path. After a torchrun
    restart (``--max-restarts``) ``"auto"`` is implied.

    Returns a :class:`TrainResult` with ``status`` ``"finished"`` or
    ``"stopped"`` (SIGINT/SIGTERM: checkpoint written, safe to exit 0).
    Raises :class:`~pointforge.errors.UserError` subclasses for problems a user
    can fix, :class:`TrainingDiverged` and
    :class:`~pointforge.train.dist.DistributedFailure` for failed runs.
    """
    if cfg.run.task and cfg.run.task != task.name:
        raise ConfigError(f"this config is for task '{cfg.run.task}', not '{task.name}'")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, task=task.name))
    if wandb:
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, wandb=True))
    task.configure(cfg.task)
    env = init_distributed(cfg.run.device, cfg.dist.backend, cfg.dist.timeout_s)
    try:
        return _Trainer(task, cfg, env, resume=resume, console=console).run()
    finally:
        shutdown_distributed(env)


# --------------------------------------------------------------------------- the trainer


class _Trainer:
    """One rank's run, assembled from parts that hold their own state.

    ``state`` (:class:`TrainState`: progress and best metric) is what a
    checkpoint's ``progress`` saves; ``window`` (:class:`MetricWindow`) is
    what the next log line reports; the plan, optimizer, scheduler, scaler and
    EMA are built in :meth:`_setup`. The methods below follow a run's order:
    set up, resume, the epoch loop, one step, logging, evaluation, saving, the end.
    """

    def __init__(self, task: Task, cfg: TrainConfig, env: DistEnv, *, resume: Any, console: bool):
        self.task = task
        self.cfg = cfg
        self.env = env
        self.resume_arg = str(resume) if resume is not None else None
        if self.resume_arg is None and env.restart_count > 0:
            self.resume_arg = "auto"
        self.console = console
        self.run_dir = Path(cfg.run.dir)
        self.device = env.device
        self.doing = "starting up"
        self.state = TrainState(world_size=env.world_size, best=BestMetric(*best_rule(task, cfg)))
        self.window = MetricWindow()
        self.last_metrics: dict[str, float] = {}
        self.last_saved_step: int | None = None
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self._picked: dict[str, Any] | None = None
        # resources released in run()'s finally
        self.loader = None
        self.iterator = None
        self.status: RunStatus | None = None
        self.writer: MetricsWriter | None = None
        self.progress: Progress | None = None
        self.logs: LogSetup | None = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> TrainResult:
        self._lock_run_dir()
        try:
            return self._run_locked()
        finally:
            self.lock.release()

    def _lock_run_dir(self) -> None:
        """Rank 0 takes the run dir's lock before anything is written there; every rank learns if it could not.

        Nothing is written before this (not even ``train.log``), so a refused
        second job leaves the running job's files exactly as they were.
        """
        env = self.env
        self.lock = RunDirLock(self.run_dir)
        refusal = None
        if env.is_main:
            try:
                self.lock.acquire()
            except UserError as err:
                refusal = (type(err).__name__, str(err))
        refusal = broadcast_object(env, refusal)
        if refusal is not None:
            kind, message = refusal
            raise (RunDirInUse if kind == "RunDirInUse" else UserError)(message)

    def _run_locked(self) -> TrainResult:
        env = self.env
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs = LogSetup(self.run_dir, env.rank, console=self.console)
        failed = False
        try:
            self._write_rank_file()
            self._setup()
            with stop_signals() as stopper:
                result = self._loop(stopper)
            return result
        except BaseException as err:
            failed = True
            message = self._failure(err)
            if self.status is not None:
                with contextlib.suppress(Exception):
                    self.status.update(status="failed", error=message.splitlines()[0][:500])
            if isinstance(err, (UserError, TrainingDiverged, DistributedFailure, KeyboardInterrupt)):
                raise
            if env.distributed:
                raise DistributedFailure(message) from err
            raise
        finally:
            shutdown_loader(self.loader, self.iterator)
            self.iterator = None
            if self.progress is not None:
                self.progress.close()
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.close(failed=failed)
            self.logs.close()

    def _failure(self, err: BaseException) -> str:
        """The one-paragraph account of a failure, recorded in train.log.

        The console gets it from whoever handles the exception (the CLI prints
        it once), so it is logged to the file only.
        """
        if isinstance(err, KeyboardInterrupt):
            message = "interrupted"
        elif isinstance(err, (UserError, TrainingDiverged, DistributedFailure)):
            message = str(err)
        elif self.env.distributed:
            message = failure_message(self.env, self.doing, err)
        else:
            first = str(err).strip().splitlines()
            message = f"failed while {self.doing}: {type(err).__name__}: {first[0] if first else ''}"
        log.error(f"error: {message}", extra={"file_only": True})
        return message

    def _write_rank_file(self) -> None:
        env = self.env
        atomic_write_json(
            self.run_dir / "ranks" / f"rank{env.rank}.json",
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

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """Build everything a step needs, in the order the ranks must agree on."""
        self.doing = "setting up"
        self._set_precision()
        self._build_model_and_data()
        self._plan_run()
        if self.env.is_main:
            for line in self.plan.lines():
                log.info(line)
        self._preflight()
        self._resume()
        self._wrap_model()
        if self.env.is_main:
            self._open_records()

    def _set_precision(self) -> None:
        perf = self.cfg.perf
        if perf.threads:
            torch.set_num_threads(perf.threads)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = perf.tf32
            torch.backends.cudnn.allow_tf32 = perf.tf32
        self.amp_dtype = self._amp_dtype()
        if self.amp_dtype is None:
            self._autocast = contextlib.nullcontext
        else:
            device_type, dtype = self.device.type, self.amp_dtype
            self._autocast = lambda: torch.autocast(device_type, dtype=dtype)

    def _build_model_and_data(self) -> None:
        cfg, task = self.cfg, self.task
        # Same seed on every rank for the weights and the data; per-rank seeds after.
        seed_everything(derive_seed(cfg.train.seed, "init"))
        model = task.build_model(cfg.task)
        if not isinstance(model, nn.Module):
            raise TypeError(f"task {task.name!r} build_model returned {type(model).__name__}, not an nn.Module")
        if cfg.perf.channels_last:
            _to_channels_last(model)
        self.model = model.to(self.device)
        self.train_ds, self.val_ds = task.build_datasets(cfg.task)
        seed_everything(derive_seed(cfg.train.seed, "rank", self.env.rank))

    def _plan_run(self) -> None:
        """The run plan, and the optimizer, schedule, scaler and EMA it implies."""
        cfg, env, task = self.cfg, self.env, self.task
        devices = [str(self.device)] * env.world_size if env.world_size > 1 else [str(self.device)]
        self.plan = make_plan(
            task,
            cfg,
            world_size=env.world_size,
            backend=env.backend or "single process",
            devices=devices,
            train_ds=self.train_ds,
            val_ds=self.val_ds,
            rank=env.rank,
        )
        if env.world_size > 1:
            # The plan each rank prints must agree; a rank whose view differs is
            # caught here rather than mid-epoch.
            check_equal(
                env,
                self.plan.steps_per_epoch,
                "the number of steps per epoch",
                "the task's batch_sampler must give every rank the same number of batches",
            )
        self.batch = self.plan.batch
        self.total_steps = self.plan.total_steps
        self.peak_lr = self.plan.lr_scaled
        self.state.rebatch(self.batch.global_batch, env.world_size, self.plan.steps_per_epoch)
        self.optimizer = build_optimizer(task.parameters(self.model), cfg.optim, self.peak_lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.sched, self.total_steps, self._time_progress())
        self.scaler = torch.amp.GradScaler("cuda") if cfg.perf.amp == "fp16" else None
        self.ema = EMA(self.model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.files = ckpt_io.CheckpointFiles(self.run_dir, cfg.ckpt.keep_last)

    def _time_progress(self) -> Callable[[int], float] | None:
        """With ``sched.horizon_minutes``: the schedule's progress is training time, the same on every rank."""
        horizon = self.cfg.sched.horizon_minutes
        if horizon is None:
            return None
        return lambda _step: self.state.train_seconds / (horizon * 60)

    def _preflight(self) -> None:
        """Faults found before the first step, not hours into the run: a dataset file gone, a disk too small.

        Each rank stats its own datasets' files (on several nodes each may read
        its own copy); rank 0 checks the run dir's free space. Every rank then
        raises the first problem found anywhere, so none waits in a collective.
        """
        env, cfg = self.env, self.cfg
        self.doing = "checking the dataset files and the disk"
        findings: list[Finding] = []
        try:
            findings.append(check_datasets(self.train_ds, self.val_ds))
            findings.append(
                check_memory(
                    self.task, cfg.task, self.batch.micro_batch, self.device, global_batch=cfg.data.global_batch
                )
            )
            if env.is_main:
                size = ckpt_io.estimate_checkpoint_bytes(self.model, optimizer=cfg.optim.name, ema=bool(self.ema))
                findings.append(
                    check_disk(
                        self.run_dir,
                        size,
                        keep_last=cfg.ckpt.keep_last,
                        every_epochs=cfg.ckpt.every_epochs,
                        epochs=cfg.train.epochs,
                    )
                )
        except UserError as err:
            findings.append(Finding("preflight", FAILURE, str(err), "", type(err)))
        problem = next((f for f in findings if not f.ok), None)
        if problem is not None and env.distributed:
            problem = dataclasses.replace(problem, detail=f"rank {env.rank}: {problem.detail}")
        found = [p for p in all_gather_objects(env, problem) if p is not None]
        if found:
            found[0].raise_if_failed()
        for finding in findings:
            if finding.status == WARNING:
                log.warning(finding.problem)

    def _wrap_model(self) -> None:
        """DDP and ``torch.compile`` around the bare model (which checkpoints and EMA keep using)."""
        env, perf = self.env, self.cfg.perf
        self.train_model: nn.Module = self.model
        self._where: dict[str, int] = {}
        if env.distributed:
            ddp_kwargs: dict[str, Any] = {"find_unused_parameters": self.cfg.dist.find_unused_parameters}
            if self.device.type == "cuda":
                ddp_kwargs["device_ids"] = [self.device.index]
                ddp_kwargs["output_device"] = self.device.index
            self.train_model = nn.parallel.DistributedDataParallel(self.model, **ddp_kwargs)
            # Marks the moment a rank leaves its forward pass, so a timeout can
            # tell a rank stuck computing from one waiting in the gradient all-reduce.
            # (Not under torch.compile, which would have to trace the hook.)
            if not perf.compile:
                self.model.register_forward_hook(
                    lambda *_: report(env, "in backward (gradient all-reduce)", **self._where)
                )
        if perf.compile:
            self.train_model = torch.compile(self.train_model)

    def _open_records(self) -> None:
        """Rank 0's config copy, ``run.json``, metrics writers and progress bar."""
        cfg, env, state = self.cfg, self.env, self.state
        save_yaml(cfg, self.run_dir / "config.yaml")
        self.status = RunStatus(
            self.run_dir / "run.json",
            task=self.task.name,
            run_dir=str(self.run_dir),
            world_size=env.world_size,
            restarts=env.restart_count,
            pointforge_version=__version__,
            total_steps=self.total_steps,
            steps_per_epoch=self.plan.steps_per_epoch,
            epochs=cfg.train.epochs,
        )
        self.status.update(
            status="running",
            epoch=state.epoch,
            global_step=state.global_step,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            last_checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            error=None,
        )
        self.writer = MetricsWriter(
            self.run_dir,
            cfg.log,
            config=to_dict(cfg),
            run_name=f"{self.task.name}:{self.run_dir.name}",
            resume=self.resumed_from is not None,
        )
        self.progress = Progress(cfg.log.progress, self.total_steps, state.global_step)

    def _amp_dtype(self) -> torch.dtype | None:
        amp = self.cfg.perf.amp
        if amp == "none":
            return None
        if amp == "fp16":
            if self.device.type != "cuda":
                raise ConfigError(
                    "perf.amp=fp16 needs a CUDA device (it relies on a GradScaler); use perf.amp=bf16 on the CPU"
                )
            return torch.float16
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise DeviceError(
                f"perf.amp=bf16 is not supported by {torch.cuda.get_device_name(self.device)}; use perf.amp=fp16"
            )
        return torch.bfloat16

    # ------------------------------------------------------------------ resume

    def _pick_checkpoint(self) -> dict[str, Any]:
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

    def _resume(self) -> None:
        env = self.env
        self.doing = "choosing a checkpoint to resume from"
        decision = self._pick_checkpoint() if env.is_main else None
        decision = broadcast_object(env, decision)
        if "error" in decision:
            kind, message = decision["error"]
            raise (CheckpointError if kind == "CheckpointError" else ConfigError)(message)
        if decision["path"] is None:
            return
        path = Path(decision["path"])
        self.doing = f"loading checkpoint {path}"
        # Rank 0 already holds the file it validated; the others read it now
        # (on several nodes the run dir must be on a shared filesystem).
        state = self._picked if self._picked is not None else ckpt_io.load_checkpoint(path)
        self._picked = None
        if not ckpt_io.is_pointforge_checkpoint(state):
            raise CheckpointError(
                f"{path} is not a pointforge training checkpoint; to start from its weights, import it with pointforge ckpt remap"
            )
        if state.get("task") != self.task.name:
            raise CheckpointError(
                f"checkpoint {path} was written by task '{state.get('task')}', not '{self.task.name}'"
            )
        self._restore(state, path)

    def _restore(self, ckpt: Mapping[str, Any], path: Path) -> None:
        cfg, env = self.cfg, self.env
        old_cfg = ckpt.get("config") or {}
        changed = _config_changes(old_cfg, to_dict(cfg))
        if changed and env.is_main:
            log.warning(
                "config differs from the checkpoint's: " + "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
            )
        ckpt_io.load_model_state(self.model, ckpt["model"])
        if self.ema is not None:
            if ckpt.get("ema") is not None:
                self.ema.load_state_dict(ckpt["ema"])
            else:
                self.ema = EMA(self.model, cfg.train.ema_decay)
        same_optimizer = (old_cfg.get("optim") or {}).get("name", cfg.optim.name) == cfg.optim.name
        if same_optimizer:
            try:
                self.optimizer.load_state_dict(ckpt["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise CheckpointError(
                    f"the optimizer state in {path} does not fit this model ({ckpt_io._short(err)}); check the task config"
                ) from None
        elif env.is_main:
            log.warning(
                f"optim.name changed from {(old_cfg.get('optim') or {}).get('name')} to {cfg.optim.name}; starting the optimizer state afresh"
            )
        progress = self.state
        progress.load_state_dict(ckpt.get("progress") or {})  # before the schedule, which may read its clock
        restore_scheduler(self.scheduler, ckpt["scheduler"], [self.peak_lr] * len(self.optimizer.param_groups))
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.last_metrics = dict(ckpt.get("metrics") or {})
        old_batch = progress.rebatch(self.batch.global_batch, env.world_size, self.plan.steps_per_epoch)
        if old_batch is not None and env.is_main:
            log.warning(
                f"data.global_batch changed from {old_batch} to {self.batch.global_batch}; resuming epoch {progress.epoch} at step {progress.step_in_epoch}"
            )
        rng = ckpt.get("rng") or {}
        if rng.get("world_size") == env.world_size and len(rng.get("per_rank") or []) == env.world_size:
            ckpt_io.restore_rng(rng["per_rank"][env.rank], self.device)
        else:
            seed_everything(derive_seed(cfg.train.seed, "rank", env.rank, "resume", progress.global_step))
            if env.is_main:
                log.warning(
                    f"checkpoint was written by {rng.get('world_size')} rank(s), this run has {env.world_size}: "
                    "weights, optimizer and schedule continue exactly, random streams are re-seeded"
                )
        self._refuse_nothing_left(path)
        self.last_saved_step = progress.global_step
        self.last_checkpoint = path
        self.resumed_from = path
        if env.is_main:
            log.info(
                f"resumed from {path} at epoch {progress.epoch}, step {progress.global_step} (step {progress.step_in_epoch} of the epoch)"
            )

    def _refuse_nothing_left(self, path: Path) -> None:
        """A checkpoint past this config's length is refused: it would "finish" at once, untrained.

        One exactly at the length (a finished run resumed as it was) finishes at
        once, and says so in the log: that is what the config asks for.
        """
        cfg, state = self.cfg, self.state
        finding = check_resume_point(
            path,
            epoch=state.epoch,
            global_step=state.global_step,
            epochs=cfg.train.epochs,
            max_steps=cfg.train.max_steps,
            total_steps=self.total_steps,
        )
        finding.raise_if_failed()
        if finding.status == WARNING and self.env.is_main:
            log.warning(finding.problem)

    # ------------------------------------------------------------------ the loop

    def _open_loader(self) -> None:
        """One loader for the whole run; each epoch hands its sampler that epoch's batches."""
        cfg = self.cfg
        self.sampler = EpochBatches()
        self.generator = torch.Generator()
        self.pinned = bool(cfg.data.pin_memory and self.device.type == "cuda")
        self.loader = build_loader(
            self.train_ds,
            self.sampler,
            collate_fn=self.task.collate,
            data_cfg=cfg.data,
            pin_memory=self.pinned,
            generator=self.generator,
        )

    def _loop(self, stopper) -> TrainResult:
        cfg, state = self.cfg, self.state
        self._open_loader()
        self.window.reset(self._lr())
        self.last_save_time = time.monotonic()
        self.train_model.train()
        self.stop_noted = False
        self.budget_start = time.monotonic()
        self.seconds_before = state.train_seconds  # the training clock of earlier launches
        self.out_of_time = False

        for epoch in range(state.epoch, cfg.train.epochs):
            if state.global_step >= self.total_steps or self.out_of_time:
                break
            start, n_steps = self._start_epoch(epoch)
            ran, stopped = self._run_epoch(epoch, start, n_steps, stopper)
            if stopped:
                return self._stopped(stopper)
            self.doing = f"finishing epoch {epoch}"
            check_equal(
                self.env,
                start + ran,
                f"the number of steps run in epoch {epoch}",
                "a rank's data loader ended early; check the dataset and Task.batch_sampler",
            )
            if state.step_in_epoch < n_steps:
                break  # max_steps reached mid-epoch
            self.iterator = None
            state.epoch_done(epoch)
            metrics = {}
            every = cfg.train.eval_every
            if self.val_ds is not None and every and ((epoch + 1) % every == 0 or epoch + 1 == cfg.train.epochs):
                metrics = self._evaluate(epoch)
            self._save(end_of_epoch=True, eval_metrics=metrics)

        if self.last_saved_step != state.global_step:
            self._save(end_of_epoch=False)
        return self._finished()

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        b = self.batch
        custom = self.task.batch_sampler(
            self.train_ds,
            rank=self.env.rank,
            world_size=b.world_size,
            micro_batch=b.micro_batch,
            accumulation=b.accumulation,
            seed=self.cfg.train.seed,
            epoch=epoch,
        )
        if custom is not None:
            return [list(x) for x in custom]
        return global_batches(
            len(self.train_ds),
            global_batch=b.global_batch,
            micro_batch=b.micro_batch,
            accumulation=b.accumulation,
            world_size=b.world_size,
            rank=self.env.rank,
            seed=self.cfg.train.seed,
            epoch=epoch,
        )

    def _start_epoch(self, epoch: int) -> tuple[int, int]:
        """Hand the loader this epoch's batches (from the resume point); return (first step, steps)."""
        cfg, env, accum = self.cfg, self.env, self.batch.accumulation
        self.doing = f"preparing epoch {epoch}"
        batches = self._epoch_batches(epoch)
        n_steps = len(batches) // accum
        report(env, "comparing step counts", epoch=epoch, step=self.state.global_step)
        check_equal(
            env,
            n_steps,
            f"the number of optimizer steps in epoch {epoch}",
            "every rank must get the same number of batches: use the engine's sampler (drop_last by construction) "
            "or make Task.batch_sampler return equal counts",
        )
        start = self.state.step_in_epoch if epoch == self.state.epoch else 0
        self.sampler.set(batches[start * accum : n_steps * accum])
        self.generator.manual_seed(derive_seed(cfg.train.seed, "loader", env.rank, epoch))
        set_epoch = getattr(self.train_ds, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)  # per-epoch augmentation from (seed, epoch, index): exact on resume
        self.iterator = iter(self.loader)
        return start, n_steps

    def _run_epoch(self, epoch: int, start: int, n_steps: int, stopper) -> tuple[int, bool]:
        """Steps ``start .. n_steps`` of ``epoch``, with logging and mid-epoch saves; return (steps run, stopped)."""
        cfg, state = self.cfg, self.state
        ran = 0
        for step_in_epoch in range(start, n_steps):
            if state.global_step >= self.total_steps:
                break
            self.doing = f"training (epoch {epoch}, step {state.global_step})"
            vote = self._train_step(epoch, stopper)
            ran += 1
            state.step_in_epoch = step_in_epoch + 1
            self._note_vote(vote, stopper)
            if state.global_step % cfg.log.every_steps == 0:
                self._log_window(epoch, n_steps)
            due = vote.ckpt_due or (cfg.ckpt.every_steps and state.global_step % cfg.ckpt.every_steps == 0)
            if vote.stop or (due and state.step_in_epoch < n_steps):
                self._save(end_of_epoch=False)
            if vote.stop:
                return ran, True
            if self.out_of_time:
                break
        return ran, False

    def _note_vote(self, vote: "_Vote", stopper) -> None:
        """Act on (and say once) what the ranks agreed: out of time, or stop requested."""
        if vote.time_up and not vote.stop:
            self.out_of_time = True
            if self.env.is_main:
                log.info(
                    f"time budget of {self.cfg.train.max_minutes:g} min (train.max_minutes) reached at step "
                    f"{self.state.global_step}: saving and finishing"
                )
        if vote.stop and not self.stop_noted and self.env.is_main:
            self.stop_noted = True
            log.info(
                f"stop requested ({stopper.requested or 'signal on another rank'}): saving a checkpoint and exiting"
            )

    # ------------------------------------------------------------------ one step

    def _train_step(self, epoch: int, stopper) -> "_Vote":
        """Forward/backward over the micro-batches, the ranks' vote, then the optimizer step."""
        t0 = time.perf_counter()
        self._where = {"epoch": epoch, "step": self.state.global_step}
        report(self.env, "in training_step (forward)", **self._where)
        loss_sum, data_time = self._forward_backward(epoch)
        vote = self._vote(loss_sum, epoch, stopper)
        lr_used = self._lr()
        skipped, grad_norm = self._optimizer_step(vote.mean_loss, epoch)
        self.window.add_step(
            loss=None if skipped else vote.mean_loss,
            lr=lr_used,
            grad_norm=float(grad_norm) if grad_norm is not None and self.env.is_main else None,
            data_time=data_time,
            step_time=time.perf_counter() - t0,
        )
        return vote

    def _forward_backward(self, epoch: int) -> tuple[torch.Tensor, float]:
        """``accumulation`` micro-batches; gradients reduced once (``no_sync`` on all but the last).

        Returns the summed (unscaled) loss, left on the device, and the time spent waiting for data.
        """
        env, accum = self.env, self.batch.accumulation
        losses = []
        data_time = 0.0
        for micro in range(accum):
            waited = time.perf_counter()
            batch = self._next_batch(epoch, micro)
            data_time += time.perf_counter() - waited
            ctx = StepContext(
                epoch=epoch,
                global_step=self.state.global_step,
                micro_step=micro,
                accumulation=accum,
                device=self.device,
                rank=env.rank,
                world_size=env.world_size,
                amp_dtype=self.amp_dtype,
            )
            sync = self.train_model.no_sync() if env.distributed and micro < accum - 1 else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    out = self.task.training_step(self.train_model, batch, ctx)
                loss, metrics = split_step_output(out)
                if loss.dtype != torch.float32:
                    loss = loss.float()
                scaled = loss / accum if accum > 1 else loss
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            losses.append(loss.detach())
            if metrics and env.is_main:
                self.window.add_task_metrics(metrics)
        return (losses[0] if accum == 1 else torch.stack(losses).sum()), data_time

    def _next_batch(self, epoch: int, micro: int) -> Any:
        try:
            with worker_errors():
                batch = next(self.iterator)
        except StopIteration:
            raise RuntimeError(
                f"the data loader on rank {self.env.rank} ran out after {micro} of {self.batch.accumulation} micro-batches in epoch {epoch}"
            ) from None
        if self.device.type != "cpu":  # loader output is on the CPU already
            batch = move_to_device(batch, self.device, non_blocking=self.pinned)
        return batch

    def _vote(self, loss_sum: torch.Tensor, epoch: int, stopper) -> "_Vote":
        """The step's one all-reduce: the loss and every flag a rank could otherwise decide alone."""
        cfg, env, accum = self.cfg, self.env, self.batch.accumulation
        due = (
            env.is_main
            and cfg.ckpt.every_minutes > 0
            and time.monotonic() - self.last_save_time >= cfg.ckpt.every_minutes * 60
        )
        # The budget is rank 0's clock; the reduction below carries its decision to every rank.
        time_up = (
            env.is_main
            and cfg.train.max_minutes is not None
            and time.monotonic() - self.budget_start >= cfg.train.max_minutes * 60
        )
        local = [1.0 if stopper.requested else 0.0, 1.0 if due else 0.0, 1.0 if time_up else 0.0]
        # Rank 0's training clock; the sum below hands it to every rank, so a
        # time-based schedule sets the same LR everywhere.
        local.append(self.seconds_before + time.monotonic() - self.budget_start if env.is_main else 0.0)
        if env.distributed:
            report(env, "in the step's all-reduce", epoch=epoch, step=self.state.global_step)
            # Every rank-dependent decision rides on this one reduction, so all
            # ranks skip, stop and save at the same step. A NaN or inf on any
            # rank makes the summed loss non-finite on every rank.
            flags = torch.tensor(local, device=self.device)
            reduced = all_reduce_sum(env, torch.cat([loss_sum.reshape(1), flags]))
            total, n_stop, n_due, n_time, seconds = reduced.tolist()
            mean_loss = total / (accum * env.world_size)
        else:
            mean_loss = loss_sum.item() / accum
            n_stop, n_due, n_time, seconds = local
        self.state.train_seconds = seconds
        return _Vote(mean_loss=mean_loss, stop=n_stop > 0, ckpt_due=n_due > 0, time_up=n_time > 0)

    def _optimizer_step(self, mean_loss: float, epoch: int) -> tuple[bool, torch.Tensor | None]:
        """Unscale, clip and step, or skip a non-finite step; the schedule advances either way.

        Returns (skipped, gradient norm when clipping).
        """
        cfg = self.cfg
        loss_bad = not math.isfinite(mean_loss)
        skip = loss_bad
        grad_norm = None
        if not skip:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if cfg.train.grad_clip:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
                # Gradients are identical on every rank after DDP's all-reduce, so
                # this check agrees everywhere without another collective.
                if self.scaler is None and not bool(torch.isfinite(grad_norm)):
                    skip = True
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            self._count_skip("loss" if loss_bad else "gradient norm", epoch)
        else:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.update(self.model)
        self.scheduler.step()
        self.state.advance(skipped=skip)
        return skip, grad_norm

    def _count_skip(self, what: str, epoch: int) -> None:
        """Warn about a skipped step; stop the run once ``train.max_nonfinite`` come in a row."""
        streak = self.state.count_skip()
        step, limit = self.state.global_step, self.cfg.train.max_nonfinite
        if self.env.is_main:
            log.warning(
                f"non-finite {what} at step {step} (epoch {epoch}); step skipped ({streak} in a row, limit {limit})"
            )
        if streak >= limit:
            raise TrainingDiverged(
                f"training diverged: non-finite loss for {streak} steps in a row "
                f"(train.max_nonfinite={limit}) at epoch {epoch}, step {step}; "
                "lower optim.lr, add train.grad_clip, or check the data; the last good checkpoint is "
                f"{self.last_checkpoint or 'not written yet'}"
            )

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------------ logging

    def _log_window(self, epoch: int, n_steps: int) -> None:
        env, state, window = self.env, self.state, self.window
        if not env.is_main or window.steps == 0:
            window.reset(self._lr())
            return
        metrics = window.summary(
            global_batch=self.batch.global_batch,
            accumulation=self.batch.accumulation,
            skipped_steps=state.skipped_steps,
        )
        it_s = metrics["it_per_s"]
        eta = (
            (self.total_steps - state.global_step) / it_s if it_s and math.isfinite(it_s) and it_s > 0 else float("nan")
        )
        epoch_pos = epoch + state.step_in_epoch / max(1, n_steps)
        self.writer.write(state.global_step, epoch_pos, metrics, prefix="train/")
        self.last_metrics.update({f"train/{k}": v for k, v in metrics.items()})
        line = (
            f"epoch {epoch} step {state.global_step}/{self.total_steps}  loss {metrics['loss']:.4g}  lr {metrics['lr']:.3g}  "
            f"{it_s:.2f} it/s  eta {format_duration(eta)}"
        )
        if self.progress is not None and self.progress.enabled:
            self.progress.update(
                state.global_step, f"loss {metrics['loss']:.4g} lr {metrics['lr']:.3g} {it_s:.2f} it/s"
            )
        log.info(line)
        self.status.update(
            progress_only=True, epoch=epoch, global_step=state.global_step, metrics=_jsonable(self.last_metrics)
        )
        window.reset(self._lr())

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, epoch: int) -> dict[str, float]:
        env, cfg = self.env, self.cfg
        self.doing = f"evaluating epoch {epoch}"
        model = self.ema.module if (self.ema is not None and cfg.train.eval_ema) else self.model
        out_dir = self.run_dir / "eval" / f"epoch-{epoch:04d}"
        micro = self.batch.micro_batch
        placement = getattr(self.task, "eval_on", "all")

        def run_on(indices_batches: list[list[int]], rank_dir: Path) -> tuple[dict[str, float], int]:
            n = sum(len(b) for b in indices_batches)
            gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "eval", env.rank, epoch))
            loader = build_loader(
                self.val_ds,
                indices_batches,
                collate_fn=self.task.collate,
                data_cfg=cfg.data,
                pin_memory=bool(cfg.data.pin_memory and self.device.type == "cuda"),
                generator=gen,
                persistent=False,
            )
            ctx = EvalContext(
                epoch=epoch,
                global_step=self.state.global_step,
                device=self.device,
                rank=env.rank,
                world_size=env.world_size,
                amp_dtype=self.amp_dtype,
                out_dir=rank_dir,
                micro_batch=micro,
            )
            was_training = model.training
            model.eval()
            try:
                with (
                    torch.no_grad(),
                    torch.autocast(
                        self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
                    ),
                ):
                    with worker_errors():
                        result = self.task.evaluate(model, loader, ctx) if n else {}
            finally:
                model.train(was_training)
                shutdown_loader(loader)
            return {k: float(v) for k, v in dict(result or {}).items()}, n

        report(env, "evaluating", epoch=epoch)
        if placement == "rank0":

            def work() -> dict[str, float]:
                metrics, _ = run_on(eval_shard(len(self.val_ds), rank=0, world_size=1, batch=micro), out_dir)
                return metrics

            metrics = rank0_section(env, f"evaluating epoch {epoch}", work, timeout_s=cfg.dist.rank0_timeout_s) or {}
        else:
            mine = eval_shard(len(self.val_ds), rank=env.rank, world_size=env.world_size, batch=micro)
            local = run_on(mine, out_dir if env.rank == 0 else out_dir / f"rank-{env.rank}")
            gathered = all_gather_objects(env, local)
            metrics = _weighted_mean(gathered)
        metrics = {k: float(v) for k, v in metrics.items()}
        if env.is_main and metrics:
            self.writer.write(self.state.global_step, float(epoch + 1), metrics)
            self.last_metrics.update(metrics)
            log.info(f"epoch {epoch} evaluation: " + "  ".join(f"{k} {v:.5g}" for k, v in metrics.items()))
            self.status.update(metrics=_jsonable(self.last_metrics))
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, rngs: list[Any]) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "config": to_dict(self.cfg),
            "model": ckpt_io.model_state(self.model),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": ckpt_io.to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": self.state.state_dict(),
            "rng": {"world_size": self.env.world_size, "per_rank": rngs},
            "metrics": _jsonable(self.last_metrics),
        }

    def _save(self, *, end_of_epoch: bool, eval_metrics: Mapping[str, float] | None = None) -> None:
        env, cfg, state = self.env, self.cfg, self.state
        self.doing = "saving a checkpoint"
        report(env, "gathering RNG states for a checkpoint", epoch=state.epoch, step=state.global_step)
        rngs = all_gather_objects(env, ckpt_io.capture_rng(self.device))
        # Every rank holds the same (gathered or broadcast) evaluation metrics,
        # so every rank records the same best and carries the same progress.
        improved = end_of_epoch and state.best.offer(
            eval_metrics or {}, state.global_step, warn=log.warning if env.is_main else None
        )

        def write() -> str:
            path = self.files.write_latest(self._checkpoint(rngs))
            if end_of_epoch and cfg.ckpt.every_epochs and state.epoch % cfg.ckpt.every_epochs == 0:
                self.files.copy_to(path, self.files.periodic(state.epoch))
                self.files.prune()
            if improved:
                self.files.copy_to(path, self.files.best)
                log.info(f"new best {state.best.metric} {state.best.value:.5g} at step {state.global_step}")
            self.status.update(
                last_checkpoint=str(path), epoch=state.epoch, global_step=state.global_step, best=state.best.summary()
            )
            return str(path)

        path = rank0_section(env, "saving a checkpoint", write, timeout_s=cfg.dist.rank0_timeout_s)
        self.last_checkpoint = Path(path) if path else None
        self.last_saved_step = state.global_step
        self.last_save_time = time.monotonic()

    # ------------------------------------------------------------------ endings

    def _result(self, status: str, signal_name: str | None = None) -> TrainResult:
        return TrainResult(
            status=status,
            run_dir=self.run_dir,
            epoch=self.state.epoch,
            global_step=self.state.global_step,
            checkpoint=self.last_checkpoint,
            metrics=dict(self.last_metrics),
            best=self.state.best.summary(),
            signal=signal_name,
            resumed_from=self.resumed_from,
        )

    def _stopped(self, stopper) -> TrainResult:
        state = self.state
        if self.env.is_main:
            log.info(
                f"stopped at epoch {state.epoch}, step {state.global_step}; checkpoint {self.last_checkpoint}; "
                "continue with --resume auto"
            )
            self.status.update(
                status="stopped", stop_signal=stopper.requested, epoch=state.epoch, global_step=state.global_step
            )
        return self._result("stopped", stopper.requested)

    def _finished(self) -> TrainResult:
        state, best = self.state, self.state.best
        if self.env.is_main:
            said = f"; best {best.metric} {best.value:.5g} (step {best.step})" if best.value is not None else ""
            log.info(
                f"finished: {state.global_step} steps, {state.epoch} epoch(s){said}; checkpoint {self.last_checkpoint}"
            )
            self.status.update(status="finished", epoch=state.epoch, global_step=state.global_step)
        return self._result("finished")


@dataclass
class _Vote:
    """What the ranks agreed in a step's all-reduce."""

    mean_loss: float  # over all ranks and micro-batches; non-finite if any rank's was
    stop: bool  # a stop signal reached some rank
    ckpt_due: bool  # rank 0's ckpt.every_minutes clock
    time_up: bool  # rank 0's train.max_minutes clock


# --------------------------------------------------------------------------- helpers


def _weighted_mean(parts: list[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    weights: dict[str, int] = {}
    for metrics, n in parts:
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
            weights[name] = weights.get(name, 0) + n
    return {name: totals[name] / weights[name] for name in totals if weights[name] > 0}


def _jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        out[name] = json_safe(number)  # the project's one NaN policy: null
    return out


def _config_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changes += _config_changes(a, b, name + ".")
        elif a != b and name != "run.dir":
            changes.append(f"{name}: {a!r} → {b!r}")
    return changes


def _to_channels_last(model: nn.Module) -> None:
    for param in model.parameters():
        if param.dim() == 4:
            param.data = param.data.contiguous(memory_format=torch.channels_last)
        elif param.dim() == 5:
            param.data = param.data.contiguous(memory_format=torch.channels_last_3d)

"""The training engine: one loop for every task, from one CPU to many GPUs.

Entry point: :func:`train` (``--dry-run``'s plan is
:func:`pointforge.train.run_plan.dry_run_plan`). The trainer is assembled from
parts with their own state, as torchtitan assembles its trainer:

* :func:`~pointforge.train.assembly.assemble`: the model, datasets and run
  plan, built in the order the ranks agree on;
* :class:`~pointforge.train.state.TrainState`: progress and the best metric
  (a checkpoint's ``progress``);
* :class:`~pointforge.train.checkpoint.manager.Trainables`: the model with its
  optimizer, schedule, scaler and EMA;
* :class:`~pointforge.train.checkpoint.manager.CheckpointManager`: resume and save;
* :class:`~pointforge.train.epochs.EpochFeed`: the loader and each epoch's batches;
* :class:`~pointforge.train.step.TrainStep`: one optimizer step in lockstep
  (micro-batches, the ranks' vote, the update);
* :class:`~pointforge.train.evaluation.Evaluator`: the task's evaluation,
  combined across ranks;
* :class:`~pointforge.train.stopping.RunClock`: the time budget and stop
  signals, and what the ranks agreed about them;
* :class:`~pointforge.train.metrics_logger.MetricsLogger`: log lines, metric files, ``run.json``;
* :mod:`~pointforge.train.preflight`: the checks that can refuse the run.

This module holds the loop that drives them. Before each epoch the ranks
compare their step counts (a mismatch fails at once, naming ranks and
counts); after it they compare the steps they ran. Evaluation and checkpoint
writing are rank-0 work in ``rank0_section``; the other ranks never wait for
them inside a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pointforge.config.training import TrainConfig
from pointforge.errors import ConfigError, UserError
from pointforge.train.assembly import assemble
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.checkpoint.manager import CheckpointManager
from pointforge.train.dist import (
    DistEnv,
    DistributedFailure,
    StopSignal,
    all_gather_objects,
    check_equal,
    failure_message,
    init_distributed,
    shutdown_distributed,
    stop_signals,
)
from pointforge.train.epochs import EpochFeed
from pointforge.train.evaluation import Evaluator
from pointforge.train.logs import LogSetup, get_logger
from pointforge.train.metrics_logger import MetricsLogger
from pointforge.train.parallelize import set_precision, wrap_model
from pointforge.train.preflight import FAILURE, WARNING, Finding, check_datasets, check_disk, check_memory
from pointforge.train.run_dir_lock import lock_run_dir
from pointforge.train.run_plan import best_rule
from pointforge.train.state import BestMetric, TrainState
from pointforge.train.step import TrainingDiverged, TrainStep
from pointforge.train.stopping import RunClock
from pointforge.train.task import Task
from pointforge.train.torchrun import write_rank_record

__all__ = ["train", "TrainResult"]

log = get_logger("train")


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
    can fix, :class:`~pointforge.train.step.TrainingDiverged` and
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


class _Trainer:
    """One rank's run: the parts (module docs) and the loop that drives them.

    The methods follow a run's order: set up, the epoch loop, the end.
    """

    def __init__(self, task: Task, cfg: TrainConfig, env: DistEnv, *, resume: Any, console: bool):
        self.task = task
        self.cfg = cfg
        self.env = env
        resume_arg = str(resume) if resume is not None else None
        if resume_arg is None and env.restart_count > 0:
            resume_arg = "auto"
        self.console = console
        self.run_dir = Path(cfg.run.dir)
        self.device = env.device
        self.doing = "starting up"
        self.state = TrainState(world_size=env.world_size, best=BestMetric(*best_rule(task, cfg)))
        self.metrics = MetricsLogger(env, cfg, self.run_dir, task.name)
        self.checkpoints = CheckpointManager(task.name, cfg, env, self.run_dir, resume_arg)
        # resources released in run()'s finally
        self.feed: EpochFeed | None = None
        self.logs: LogSetup | None = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> TrainResult:
        lock = lock_run_dir(self.env, self.run_dir)
        try:
            return self._run_locked()
        finally:
            lock.release()

    def _run_locked(self) -> TrainResult:
        env = self.env
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs = LogSetup(self.run_dir, env.rank, console=self.console)
        failed = False
        try:
            write_rank_record(self.run_dir, env)
            self._setup()
            with stop_signals() as stopper:
                return self._loop(stopper)
        except BaseException as err:
            failed = True
            message = self._failure(err)
            with contextlib.suppress(Exception):
                self.metrics.update_status(status="failed", error=message.splitlines()[0][:500])
            if isinstance(err, (UserError, TrainingDiverged, DistributedFailure, KeyboardInterrupt)):
                raise
            if env.distributed:
                raise DistributedFailure(message) from err
            raise
        finally:
            if self.feed is not None:
                self.feed.close()
            self.metrics.close(failed=failed)
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

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """Build everything a step needs, in the order the ranks must agree on."""
        self.doing = "setting up"
        dtype = set_precision(self.cfg, self.device)
        built = assemble(self.task, self.cfg, self.env, self.state)
        self.model, self.train_ds, self.val_ds, self.parts = built.model, built.train_ds, built.val_ds, built.parts
        self.plan, self.batch = built.plan, built.plan.batch
        self.total_steps, self.peak_lr = built.plan.total_steps, built.plan.lr_scaled
        if self.env.is_main:
            for line in self.plan.lines():
                log.info(line)
        self._preflight()
        self._resume()
        where: dict[str, int] = {}
        self.step = TrainStep(
            self.task,
            self.cfg,
            self.env,
            parts=self.parts,
            train_model=wrap_model(self.model, self.cfg, self.env, where),
            batch=self.batch,
            state=self.state,
            window=self.metrics.window,
            dtype=dtype,
            where=where,
            last_checkpoint=lambda: self.checkpoints.last_checkpoint,
        )
        self.evaluator = Evaluator(
            self.task,
            self.cfg,
            self.env,
            self.val_ds,
            device=self.device,
            amp_dtype=dtype,
            micro_batch=self.batch.micro_batch,
            run_dir=self.run_dir,
        )
        if self.env.is_main:
            ckpts = self.checkpoints
            self.metrics.open(
                state=self.state,
                total_steps=self.total_steps,
                steps_per_epoch=self.plan.steps_per_epoch,
                resumed_from=ckpts.resumed_from,
                last_checkpoint=ckpts.last_checkpoint,
            )

    def _preflight(self) -> None:
        """Faults found before the first step, not hours into the run: a dataset file gone, a disk too small.

        Each rank checks its own datasets' files (on several nodes each may read
        its own copy) and memory; rank 0 checks the run dir's disk. Every rank
        then raises the first problem found anywhere, so none waits in a collective.
        """
        env, cfg = self.env, self.cfg
        self.doing = "checking the dataset files and the disk"
        findings: list[Finding] = []
        try:
            findings.append(check_datasets(self.train_ds, self.val_ds))
            micro, global_batch = self.batch.micro_batch, cfg.data.global_batch
            findings.append(check_memory(self.task, cfg.task, micro, self.device, global_batch=global_batch))
            if env.is_main:
                ema = bool(self.parts.ema)
                size = ckpt_io.estimate_checkpoint_bytes(self.model, optimizer=cfg.optim.name, ema=ema)
                kept = {"keep_last": cfg.ckpt.keep_last, "every_epochs": cfg.ckpt.every_epochs}
                findings.append(check_disk(self.run_dir, size, epochs=cfg.train.epochs, **kept))
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

    def _resume(self) -> None:
        """Continue from the checkpoint the run asks for, if any (:meth:`CheckpointManager.resume`)."""
        self.doing = "resuming from a checkpoint"
        self.checkpoints.resume(
            self.parts,
            self.state,
            self.metrics,
            peak_lr=self.peak_lr,
            global_batch=self.batch.global_batch,
            steps_per_epoch=self.plan.steps_per_epoch,
            total_steps=self.total_steps,
        )

    # ------------------------------------------------------------------ the loop

    def _loop(self, stopper: StopSignal) -> TrainResult:
        cfg, state = self.cfg, self.state
        feed = self.feed = EpochFeed(self.task, cfg, self.env, self.train_ds, self.batch, pinned=self.step.pinned)
        feed.open()
        self.metrics.window.reset(self.step.lr())
        self.checkpoints.last_save_time = time.monotonic()
        self.step.train_model.train()
        clock = self.clock = RunClock(self.env, cfg.train.max_minutes, state.train_seconds)

        for epoch in range(state.epoch, cfg.train.epochs):
            if state.global_step >= self.total_steps or clock.out_of_time:
                break
            self.doing = f"preparing epoch {epoch}"
            start, n_steps = feed.start(epoch, state)
            ran, stopped = self._run_epoch(feed, epoch, start, n_steps, stopper)
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
            feed.end_epoch()
            state.epoch_done(epoch)
            metrics = self._evaluate(epoch) if self.evaluator.due(epoch) else {}
            self._save(end_of_epoch=True, eval_metrics=metrics)

        if self.checkpoints.last_saved_step != state.global_step:
            self._save(end_of_epoch=False)
        return self._finished()

    def _run_epoch(
        self, feed: EpochFeed, epoch: int, start: int, n_steps: int, stopper: StopSignal
    ) -> tuple[int, bool]:
        """Steps ``start .. n_steps`` of ``epoch``, with logging and mid-epoch saves; return (steps run, stopped)."""
        cfg, state = self.cfg, self.state
        ran = 0
        for step_in_epoch in range(start, n_steps):
            if state.global_step >= self.total_steps:
                break
            self.doing = f"training (epoch {epoch}, step {state.global_step})"
            vote = self.step.run(
                epoch, feed.batches(), lambda: self.clock.flags(stopper, self.checkpoints.due_by_time())
            )
            ran += 1
            state.step_in_epoch = step_in_epoch + 1
            self.clock.note(vote, stopper, state.global_step)
            if state.global_step % cfg.log.every_steps == 0:
                self.metrics.log_window(
                    epoch=epoch,
                    n_steps=n_steps,
                    state=state,
                    batch=self.batch,
                    total_steps=self.total_steps,
                    lr=self.step.lr(),
                )
            due = vote.ckpt_due or (cfg.ckpt.every_steps and state.global_step % cfg.ckpt.every_steps == 0)
            if vote.stop or (due and state.step_in_epoch < n_steps):
                self._save(end_of_epoch=False)
            if vote.stop:
                return ran, True
            if self.clock.out_of_time:
                break
        return ran, False

    def _evaluate(self, epoch: int) -> dict[str, float]:
        self.doing = f"evaluating epoch {epoch}"
        ema = self.parts.ema
        model = ema.module if (ema is not None and self.cfg.train.eval_ema) else self.model
        metrics = self.evaluator.evaluate(model, epoch, self.state.global_step)
        self.metrics.record_eval(global_step=self.state.global_step, epoch=epoch, metrics=metrics)
        if self.env.is_main and metrics:
            for warning in self.task.health(metrics):
                log.warning(f"step {self.state.global_step}: {warning}")
        return metrics

    def _save(self, *, end_of_epoch: bool, eval_metrics: dict[str, float] | None = None) -> None:
        self.doing = "saving a checkpoint"
        self.checkpoints.save(
            self.parts, self.state, self.metrics, self.device, end_of_epoch=end_of_epoch, eval_metrics=eval_metrics
        )

    # ------------------------------------------------------------------ endings

    def _result(self, status: str, signal_name: str | None = None) -> TrainResult:
        return TrainResult(
            status=status,
            run_dir=self.run_dir,
            epoch=self.state.epoch,
            global_step=self.state.global_step,
            checkpoint=self.checkpoints.last_checkpoint,
            metrics=dict(self.metrics.last),
            best=self.state.best.summary(),
            signal=signal_name,
            resumed_from=self.checkpoints.resumed_from,
        )

    def _stopped(self, stopper: StopSignal) -> TrainResult:
        state, last = self.state, self.checkpoints.last_checkpoint
        if self.env.is_main:
            log.info(
                f"stopped at epoch {state.epoch}, step {state.global_step}; checkpoint {last}; "
                "continue with --resume auto"
            )
            self.metrics.update_status(
                status="stopped", stop_signal=stopper.requested, epoch=state.epoch, global_step=state.global_step
            )
        return self._result("stopped", stopper.requested)

    def _finished(self) -> TrainResult:
        state, best, last = self.state, self.state.best, self.checkpoints.last_checkpoint
        if self.env.is_main:
            said = f"; best {best.metric} {best.value:.5g} (step {best.step})" if best.value is not None else ""
            log.info(f"finished: {state.global_step} steps, {state.epoch} epoch(s){said}; checkpoint {last}")
            self.metrics.update_status(status="finished", epoch=state.epoch, global_step=state.global_step)
        return self._result("finished")

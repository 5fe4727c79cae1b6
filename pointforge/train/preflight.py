"""Preflight: every check that can refuse a training run, each computed one way.

The engine runs these before its first step, ``pointforge launch`` before it
starts a job, and ``pointforge doctor`` to report on a machine; all three ask
the functions below, so they cannot disagree about a run. A check returns a
plain :class:`Finding` and raises nothing: the engine turns a failure into
its error (:meth:`Finding.raise_if_failed`), doctor prints it, launch lists it
as a problem of the plan.

The API (stable; other modules build on it):

``Finding(check, status, detail, fix="", error=UserError)``
    ``status`` is :data:`OK`, :data:`WARNING` or :data:`FAILURE`; ``detail``
    says what was found, ``fix`` what to do about it; ``error`` is the
    :class:`~pointforge.errors.UserError` subclass a failure is raised as.
    ``ok`` (not a failure), ``problem`` (detail and fix in one line) and
    ``raise_if_failed()``.

``check_run_dir_lock(run_dir)``
    Another live job holds the run dir's lock (:mod:`pointforge.train.run_dir_lock`).

``check_existing_checkpoints(run_dir, resume)``
    A fresh start (``resume`` None) in a run dir that already holds checkpoints.

``check_disk(run_dir, checkpoint_bytes, *, keep_last, every_epochs, epochs, free=None)``
    The run's checkpoints fit on the run dir's disk: the most files it keeps
    at once, less what its existing checkpoints already take (at least one
    checkpoint's worth); a warning under twice that. ``free`` stands in for
    the disk's free bytes (doctor's what-if questions).

``check_memory(task, task_cfg, micro_batch, device, *, global_batch, available=None)``
    The task's estimate of a step's memory fits the device, else the largest
    micro-batch that does, and each of the task's memory savers
    (``Task.memory_savers``, e.g. activation checkpointing) under which a larger one does.

``check_compile(task, compile)``
    ``perf.compile=true`` for a task that says it cannot be compiled (``Task.compile_refusal``).

``check_datasets(*datasets)``
    Each dataset's own ``check_files()``: the files it will read exist.

``check_resume_point(path, *, epoch, global_step, epochs, max_steps, total_steps=None)``
    A checkpoint past the config's length is refused (it would "finish" at
    once, untrained); one exactly at it is a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pointforge.devices import available_memory_bytes
from pointforge.errors import ConfigError, DiskFullError, UserError
from pointforge.formats import format_bytes
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.run_dir_lock import RunDirInUse, in_use_message, lock_holder
from pointforge.train.task import Task

__all__ = [
    "OK",
    "WARNING",
    "FAILURE",
    "Finding",
    "check_run_dir_lock",
    "check_existing_checkpoints",
    "check_disk",
    "check_memory",
    "check_compile",
    "check_datasets",
    "check_resume_point",
]

OK, WARNING, FAILURE = "ok", "warning", "failure"


@dataclass(frozen=True)
class Finding:
    """What one check found: its status, one line of detail and, when not ok, one line saying what to do."""

    check: str
    status: str
    detail: str
    fix: str = ""
    error: type[UserError] = UserError

    @property
    def ok(self) -> bool:
        return self.status != FAILURE

    @property
    def problem(self) -> str:
        return f"{self.detail}; {self.fix}" if self.fix else self.detail

    def raise_if_failed(self) -> None:
        if self.status == FAILURE:
            raise self.error(self.problem)


def _split(message: str) -> tuple[str, str]:
    """A one-line message as (what, what to do): split at its first '; '."""
    detail, _, fix = message.partition("; ")
    return detail, fix


def check_run_dir_lock(run_dir: str | os.PathLike) -> Finding:
    """Free, or held by another live job (named, with how to stop it)."""
    holder = lock_holder(run_dir)
    if holder is None:
        return Finding("run dir", OK, f"{run_dir} is not in use by another job")
    detail, fix = _split(in_use_message(run_dir, holder))
    return Finding("run dir", FAILURE, detail, fix, RunDirInUse)


def check_existing_checkpoints(run_dir: str | os.PathLike, resume: str | None) -> Finding:
    """A fresh start is refused in a run dir holding an earlier run's checkpoints (its history would mix)."""
    existing = ckpt_io.resume_candidates(run_dir) if resume is None else []
    if not existing:
        return Finding("run dir", OK, f"{run_dir} holds no earlier run's checkpoints" if resume is None else "resuming")
    return Finding(
        "run dir",
        FAILURE,
        f"run dir {run_dir} already holds checkpoints ({existing[0].name}, ...) from an earlier run",
        "add --resume auto to continue it, or choose a new run.dir",
        ConfigError,
    )


def check_disk(
    run_dir: str | os.PathLike,
    checkpoint_bytes: int | None,
    *,
    keep_last: int,
    every_epochs: int = 1,
    epochs: int | None = None,
    free: int | None = None,
) -> Finding:
    """Room on the run dir's disk for the checkpoints the run will keep, beyond those already there."""
    free = free if free is not None else ckpt_io.disk_free_bytes(run_dir)
    if free is None:
        return Finding(
            "disk",
            WARNING,
            f"cannot tell the free space for {run_dir}",
            "check that the run dir's filesystem is mounted",
        )
    if checkpoint_bytes is None:
        return Finding("disk", OK, f"{format_bytes(free)} free for {run_dir} (checkpoint size unknown)")
    files = ckpt_io.checkpoint_files_kept(keep_last, every_epochs=every_epochs, epochs=epochs)
    existing = sum(p.stat().st_size for p in ckpt_io.resume_candidates(run_dir))
    need = max(files * checkpoint_bytes - existing, checkpoint_bytes)
    detail = (
        f"{format_bytes(free)} free for {run_dir}, its checkpoints need about {format_bytes(need)} more "
        f"({files} files × {format_bytes(checkpoint_bytes)}, ckpt.keep_last={keep_last})"
    )
    if free < need:
        return Finding(
            "disk",
            FAILURE,
            detail,
            "free disk space, lower ckpt.keep_last, or choose a run.dir on a larger disk",
            DiskFullError,
        )
    if free < 2 * need:
        return Finding("disk", WARNING, f"{detail}: less than twice that is free", "free disk space before a long run")
    return Finding("disk", OK, detail)


def check_memory(
    task: Task,
    task_cfg: Any,
    micro_batch: int,
    device: torch.device,
    *,
    global_batch: int,
    available: int | None = None,
) -> Finding:
    """A step on ``micro_batch`` samples fits the device by the task's own estimate (no estimate: ok)."""
    need = task.memory_estimate(task_cfg, micro_batch)
    if need is None:
        return Finding("memory", OK, f"task {task.name!r} does not estimate its memory")
    free = available if available is not None else available_memory_bytes(device)
    said = (
        f"a training step on {micro_batch} sample(s) per device needs about {format_bytes(need)} on {device}, "
        f"more than the {format_bytes(free)} available"
    )
    if need <= free:
        return Finding("memory", OK, f"a training step needs about {format_bytes(need)} of {format_bytes(free)}")
    fits = _largest_fitting(task, task_cfg, micro_batch - 1, free)
    savers = []
    for setting, saver_cfg in task.memory_savers(task_cfg).items():
        saved = _largest_fitting(task, saver_cfg, micro_batch, free)
        if saved > fits:
            savers.append(f"set {setting} (then data.micro_batch={saved} fits)")
    if fits:
        smaller = f"set data.micro_batch={fits} (gradient accumulation keeps data.global_batch={global_batch})"
        return Finding("memory", FAILURE, said, _one_of([smaller, *savers, "use more devices"]), ConfigError)
    return Finding(
        "memory",
        FAILURE,
        f"{said} even for one sample",
        _one_of([*savers, "lower the task's point count or grid resolution"]),
        ConfigError,
    )


def _one_of(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _largest_fitting(task: Task, task_cfg: Any, at_most: int, free: int) -> int:
    """The largest micro-batch up to ``at_most`` whose estimate fits in ``free`` bytes (0: none)."""
    return next((m for m in range(at_most, 0, -1) if (task.memory_estimate(task_cfg, m) or 0) <= free), 0)


def check_compile(task: Task, compile: bool) -> Finding:
    """``perf.compile=true`` is refused, before the first step, for a task that cannot be compiled."""
    if not compile or task.compile_refusal is None:
        return Finding("compile", OK, "torch.compile " + ("on" if compile else "off"))
    detail = f"perf.compile=true cannot train the {task.name} task: {task.compile_refusal}"
    return Finding("compile", FAILURE, detail, "set perf.compile=false", ConfigError)


def check_datasets(*datasets: Any) -> Finding:
    """Each dataset's ``check_files()`` (where it has one): a file gone is found now, not hours into the run."""
    for dataset in datasets:
        check = getattr(dataset, "check_files", None)
        if not callable(check):
            continue
        try:
            check()
        except UserError as err:
            return Finding("dataset", FAILURE, str(err), "", type(err))
    return Finding("dataset", OK, "the datasets' files are in place")


def check_resume_point(
    path: str | os.PathLike,
    *,
    epoch: int,
    global_step: int,
    epochs: int,
    max_steps: int | None,
    total_steps: int | None = None,
) -> Finding:
    """Whether a checkpoint at (``epoch``, ``global_step``) leaves anything to train under this config."""
    path = Path(path)
    again = "or choose a new run.dir to start afresh"
    if epoch > epochs:
        return Finding(
            "resume",
            FAILURE,
            f"{path} has done {epoch} epochs (step {global_step}) but train.epochs is {epochs}: nothing is left to train",
            f"set train.epochs above {epoch} (e.g. train.epochs={2 * epoch}) to train on, {again}",
            ConfigError,
        )
    if max_steps is not None and global_step > max_steps:
        return Finding(
            "resume",
            FAILURE,
            f"{path} is at step {global_step} but train.max_steps is {max_steps}: nothing is left to train",
            f"set train.max_steps above {global_step} (or train.max_steps=null) to train on, {again}",
            ConfigError,
        )
    at_end = epoch >= epochs or (total_steps is not None and global_step >= total_steps)
    if at_end:
        return Finding(
            "resume",
            WARNING,
            f"{path} already has the {global_step} steps ({epoch} epochs) this config asks for: nothing is left to train",
            "raise train.epochs (or train.max_steps) to train on",
        )
    return Finding("resume", OK, f"{path} resumes at epoch {epoch}, step {global_step}")

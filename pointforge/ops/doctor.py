"""``pointforge doctor``: check a machine, a config, a dataset and a checkpoint before a long run.

Each check ends in ``ok``, ``warning`` or ``failure`` with one line of detail
and, when it is not ok, one line saying what to do. :func:`run_doctor` runs
the checks that apply to what it is given (a config, a plan, a dataset root,
a resume checkpoint, a port, tmux) and returns a
:class:`~pointforge.ops.doctor_report.DoctorReport`; its ``failed`` property
is what the command's exit status follows. The checks themselves live by
job: :mod:`~pointforge.ops.doctor_host` (the machine),
:mod:`~pointforge.ops.doctor_run` (a run's data, disk, run dir and resume
checkpoint, through :mod:`pointforge.train.preflight`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from pointforge.config.loader import load_yaml
from pointforge.errors import UserError
from pointforge.ops.doctor_host import (
    DEFAULT_PORT,
    check_gpus,
    check_port,
    check_python,
    check_tmux,
    check_torch,
    check_visible_devices,
)
from pointforge.ops.doctor_report import Check, DoctorReport, guard
from pointforge.ops.doctor_run import (
    batch_bytes_from_task,
    check_dataset,
    check_disk,
    check_resume,
    check_run_dir,
    check_shm,
    dataset_root_from_config,
    dev_shm_space,
    estimate_checkpoint_bytes,
)
from pointforge.ops.host import GpuInventory, format_gpu_list, gpu_inventory
from pointforge.ops.launch.plan import build_plan
from pointforge.ops.launch.spec import load_plan
from pointforge.tasks import available_tasks, get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.preflight import FAILURE, OK
from pointforge.train.schedule import plan_batches

# --------------------------------------------------------------------------- the whole run


def _config_checks(
    label: str,
    task: Any,
    cfg: Any,
    *,
    nproc: int,
    data: str | None,
    resume: str | None,
    shm_space: tuple[int, int] | None,
    disk_space: tuple[int, int] | None,
) -> list[Check]:
    checks: list[Check] = []
    prefix = f"{label}: " if label else ""

    def named(items: list[Check]) -> list[Check]:
        for c in items:
            c.name = prefix + c.name
        return items

    root = data or dataset_root_from_config(cfg.task)
    if root:
        checks += named(guard("dataset", lambda: check_dataset(root)))
    ck_bytes = None
    if resume and resume != "auto" and Path(resume).is_file():
        ck_bytes = Path(resume).stat().st_size
    if ck_bytes is None:
        ck_bytes = estimate_checkpoint_bytes(task, cfg)
    checks += named(
        guard(
            "disk",
            lambda: check_disk(
                cfg.run.dir,
                ck_bytes,
                cfg.ckpt.keep_last,
                space=disk_space,
                every_epochs=cfg.ckpt.every_epochs,
                epochs=cfg.train.epochs,
            ),
        )
    )
    workers = cfg.data.num_workers
    if workers:
        try:
            micro = plan_batches(cfg.data.global_batch, nproc, cfg.data.micro_batch).micro_batch
        except UserError:
            micro = max(1, cfg.data.global_batch // nproc)
        batch = batch_bytes_from_task(task, cfg, micro)
    else:
        batch = None
    shm = shm_space if shm_space is not None else dev_shm_space()
    checks += named(guard("/dev/shm", lambda: check_shm(workers, nproc, cfg.data.prefetch_factor, batch, shm=shm)))
    checks += named(guard("run dir", lambda: check_run_dir(cfg.run.dir, resume=resume)))
    if resume:
        checks += named(
            guard("resume", lambda: check_resume(resume, run_dir=cfg.run.dir, task=task, cfg=cfg, nproc=nproc))
        )
    return checks


def run_doctor(
    *,
    config: str | os.PathLike | None = None,
    task: str | None = None,
    overrides: Sequence[str] = (),
    data: str | os.PathLike | None = None,
    resume: str | None = None,
    plan: str | os.PathLike | None = None,
    nproc: int | None = None,
    port: int | None = None,
    tmux: bool = False,
    run_dir: str | os.PathLike | None = None,
    shm_space: tuple[int, int] | None = None,
    disk_space: tuple[int, int] | None = None,
) -> DoctorReport:
    """Run every check that applies. ``shm_space``/``disk_space`` ((total, free) bytes) stand in for
    the real filesystems, for tests and what-if questions."""
    report = DoctorReport()
    add = report.checks.extend
    inventory = gpu_inventory(details=True)
    launch_plan, plan_check = _load_launch_plan(plan)
    if plan_check is not None:
        add([plan_check])
    task_obj, cfg, config_check = _load_config(config, task, overrides, run_dir)

    physical_needed, visible_needed, needs_cuda = _gpus_needed(inventory, launch_plan, cfg, nproc)
    add([check_python()])
    add(guard("torch", lambda: check_torch(needs_cuda)))
    add(guard("GPUs", lambda: check_gpus(inventory, physical_needed=physical_needed, visible_needed=visible_needed)))
    add(
        guard(
            "CUDA_VISIBLE_DEVICES",
            lambda: check_visible_devices(inventory, for_plan=launch_plan is not None, gpus_needed=needs_cuda),
        )
    )
    if config_check is not None:
        add([config_check])

    data_root = str(data) if data else None
    if launch_plan is not None:
        add(_plan_checks(plan, launch_plan, data=data_root, shm_space=shm_space, disk_space=disk_space))
    elif cfg is not None:
        add(
            _config_checks(
                "",
                task_obj,
                cfg,
                nproc=nproc or 1,
                data=data_root,
                resume=resume,
                shm_space=shm_space,
                disk_space=disk_space,
            )
        )
    else:
        if data is not None:
            add(guard("dataset", lambda: check_dataset(data)))
        if run_dir is not None:
            add(guard("run dir", lambda: check_run_dir(run_dir, resume=resume)))
        if resume is not None:
            add(guard("resume", lambda: check_resume(resume, run_dir=run_dir)))

    if port is not None:
        add([check_port(port, asked=True)])
    elif launch_plan is None:
        add([check_port(DEFAULT_PORT, asked=False)])
    tmux_check = check_tmux(tmux)
    if tmux_check is not None:
        add([tmux_check])
    return report


def _load_launch_plan(plan: str | os.PathLike | None) -> tuple[Any, Check | None]:
    """The launch plan, resolved and checked (None and a failed check when it does not load)."""
    if plan is None:
        return None, None
    try:
        return build_plan(load_plan(plan)), None
    except UserError as err:
        return None, Check("plan", FAILURE, str(err), "fix the plan file")


def _load_config(
    config: str | os.PathLike | None, task: str | None, overrides: Sequence[str], run_dir: str | os.PathLike | None
) -> tuple[Any, Any, Check | None]:
    """(task, config, the config check) for ``--config``/``--task``; all None when neither is given."""
    if config is None and task is None:
        return None, None, None
    task_name = task or _task_from_config(config)
    try:
        task_obj = get_task(task_name) if task_name else None
        if task_obj is None:
            raise UserError(f"cannot tell the task of {config}; pass --task NAME")
        cfg = load_train_config(task_obj.name, config, list(overrides) + ([f"run.dir={run_dir}"] if run_dir else []))
    except UserError as err:
        return None, None, Check("config", FAILURE, str(err), "fix the config file or the override named")
    return task_obj, cfg, Check("config", OK, f"{config or 'defaults'} loads for task {task_obj.name}")


def _gpus_needed(
    inventory: GpuInventory, launch_plan: Any, cfg: Any, nproc: int | None
) -> tuple[list[int] | None, int | None, bool]:
    """(physical GPUs a plan names, GPUs a single run must see, whether CUDA is needed at all)."""
    physical_needed = sorted({g for j in launch_plan.jobs for g in j.gpus}) if launch_plan else None
    visible_needed = None
    needs_cuda = bool(launch_plan and physical_needed and not inventory.fake)
    if cfg is not None and launch_plan is None:
        device = cfg.run.device.strip().lower()
        if device.startswith("cuda:"):
            visible_needed = int(device.split(":", 1)[1]) + 1 if device.split(":", 1)[1].isdigit() else 1
        elif device == "cuda" or (device == "auto" and inventory.count and not inventory.fake):
            visible_needed = nproc or 1
        needs_cuda = needs_cuda or bool(visible_needed)
    return physical_needed, visible_needed, needs_cuda


def _plan_checks(
    plan: Any,
    launch_plan: Any,
    *,
    data: str | None,
    shm_space: tuple[int, int] | None,
    disk_space: tuple[int, int] | None,
) -> list[Check]:
    """The plan's own problems (or its summary), then every job's config checks."""
    if launch_plan.problems:
        checks = [
            Check("plan", FAILURE, str(p), "fix the plan (pointforge launch PLAN --dry-run shows it)")
            for p in launch_plan.problems
        ]
    else:
        jobs = ", ".join(
            f"{j.name} on {('GPU ' + format_gpu_list(j.gpus)) if j.gpus else 'the CPU'}"
            + (f" (port {j.port})" if j.spec.port else "")
            for j in launch_plan.jobs
        )
        checks = [Check("plan", OK, f"{plan}: {len(launch_plan.jobs)} job(s): {jobs}; GPUs, ports and run dirs free")]
    for job in launch_plan.jobs:
        try:
            job_task = get_task(job.spec.task)
            job_cfg = load_train_config(job_task.name, job.config_path, [*job.overrides, f"run.dir={job.run_dir}"])
        except UserError:
            continue  # already reported as a plan problem
        checks += _config_checks(
            f"job {job.name}",
            job_task,
            job_cfg,
            nproc=job.nproc,
            data=data,
            resume=job.resume,
            shm_space=shm_space,
            disk_space=disk_space,
        )
    return checks


def _task_from_config(config: str | os.PathLike | None) -> str | None:
    """``run.task`` in the file, else the preset folder's name when it is a task (pointforge/configs/toy/tiny.yaml → toy)."""
    if config is None:
        return None
    data = load_yaml(config)
    named = (data.get("run") or {}).get("task") if isinstance(data.get("run"), dict) else None
    if named:
        return str(named)
    folder = Path(config).resolve().parent.name
    return folder if folder in available_tasks() else None

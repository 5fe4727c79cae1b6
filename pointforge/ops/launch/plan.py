"""The launch plan resolved and checked: each job's GPUs, port, run dir, command and environment.

:func:`build_plan` walks the jobs of a :class:`~pointforge.ops.launch.spec.PlanSpec`
through one check per thing checked (name, GPUs, run dir, config, resume
point, port) and collects every problem, so the whole plan is refused at once
and nothing starts; :meth:`LaunchPlan.text` is what ``--dry-run`` prints. The
checks a training run makes itself (its run dir's lock, an earlier run's
checkpoints) are asked of :mod:`pointforge.train.preflight`, so launch and
train cannot disagree; the rest are the plan's own (GPUs, ports, names).
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from pointforge.errors import CheckpointError, ConfigError, DeviceError, UserError, raise_problems
from pointforge.ops.host import (
    FAKE_GPUS_ENV,
    GpuInventory,
    format_gpu_list,
    gpu_inventory,
    pick_free_port,
    port_free,
    port_owner,
    this_host,
)
from pointforge.ops.launch.spec import JobSpec, PlanSpec, absolute, is_stripped, job_run_dir
from pointforge.ops.runs import CONSOLE_LOG, is_live, run_state
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config, resolve_config_path
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.preflight import (
    Finding,
    check_compile,
    check_existing_checkpoints,
    check_memory,
    check_run_dir_lock,
)
from pointforge.train.run_dir_lock import RunDirInUse
from pointforge.train.schedule import plan_batches
from pointforge.train.torchrun import torchrun_command, worker_args, worker_pythonpath


@dataclass
class JobPlan:
    """One job, ready to start: its GPUs, port, run dir, command and environment."""

    spec: JobSpec
    run_dir: Path
    nproc: int
    device: str  # "cuda" or "cpu"
    visible_devices: str
    port: int
    command: list[str]
    env_set: dict[str, str]
    env_unset: list[str]  # variables present in this shell that the job does not get
    resume: str | None
    config_path: Path | None = None
    overrides: list[str] = field(default_factory=list)  # as passed to the job (plan's, command line's, run.device)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gpus(self) -> list[int]:
        return self.spec.gpus

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if not is_stripped(k)}
        env.update(self.env_set)
        return env

    def gpu_map(self) -> list[tuple[int, str]]:
        return [(g, f"cuda:{i}") for i, g in enumerate(self.gpus)]

    def record(self, *, mode: str, session: str | None, plan: Path | None, faked: bool) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.spec.task,
            "config": self.spec.config,
            "run_dir": str(self.run_dir),
            "gpus": self.gpus,
            "visible_devices": self.visible_devices,
            "device": self.device,
            "nproc": self.nproc,
            "port": self.port,
            "resume": self.resume,
            "max_restarts": self.spec.max_restarts,
            "command": self.command,
            "env_set": self.env_set,
            "env_unset": self.env_unset,
            "mode": mode,
            "tmux_session": session,
            "plan": str(plan) if plan else None,
            "faked_gpus": faked,
            "host": this_host(),
            "launched_at": time.time(),
            "launcher_pid": os.getpid(),
        }


@dataclass
class LaunchPlan:
    jobs: list[JobPlan]
    inventory: GpuInventory
    session: str
    cwd: Path
    source: Path | None
    problems: list[UserError] = field(default_factory=list)

    @property
    def faked(self) -> bool:
        return self.inventory.fake

    def check(self) -> None:
        """Raise when the plan has problems: one problem as itself, several as one line."""
        raise_problems(self.problems, "plan refused, nothing started")

    def text(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        inv = self.inventory
        lines = [
            f"pointforge launch — {len(self.jobs)} job(s) on {this_host()}, {inv.describe()}",
            "  GPU numbers are physical (as nvidia-smi numbers them); each job sees only its own GPUs,",
            "  as cuda:0 … cuda:k-1 (CUDA_VISIBLE_DEVICES per job, CUDA_DEVICE_ORDER=PCI_BUS_ID).",
        ]
        if self.faked:
            lines.append(
                f"  {FAKE_GPUS_ENV} is set: the GPUs are faked and every job runs its processes on the CPU (run.device=cpu, gloo)."
            )
        shell_mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        if shell_mask is not None:
            lines.append(f"  this shell's CUDA_VISIBLE_DEVICES={shell_mask!r} is not passed on: each job gets its own.")
        for job in self.jobs:
            lines.append("")
            lines.append(f"job {job.name}  (task {job.spec.task}, config {job.spec.config or 'none (defaults)'})")
            lines.append(f"  run dir      {job.run_dir}")
            if job.gpus:
                mapping = "  ".join(f"{g}→{c}" for g, c in job.gpu_map())
                cpu = " (on the CPU: faked)" if job.device == "cpu" else ""
                lines.append(f"  GPUs         physical {format_gpu_list(job.gpus)}: {mapping}{cpu}")
            else:
                lines.append("  GPUs         none (CUDA_VISIBLE_DEVICES empty; CPU job)")
            kind = "DDP" if job.nproc > 1 else "one process"
            backend = "nccl" if job.device == "cuda" else "gloo"
            lines.append(f"  processes    {job.nproc} ({kind}, {backend if job.nproc > 1 else job.device})")
            lines.append(f"  rendezvous   localhost:{job.port} (free now)")
            lines.append(f"  resume       {job.resume or 'no (new run)'}")
            lines.append(
                f"  logs         {job.run_dir / CONSOLE_LOG} (all output), {job.run_dir / 'train.log'} (rank 0)"
            )
            for note in job.notes:
                lines.append(f"  note         {note}")
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job.env_set.items())
            lines.append(f"  environment  this shell's, plus {env}")
            if job.env_unset:
                lines.append(f"               without {' '.join(job.env_unset)}")
            lines.append(f"  command      {shlex.join(job.command)}")
        return lines


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def _as(err: UserError, prefix: str) -> UserError:
    return type(err)(f"{prefix}: {err}")


@dataclass
class _Planning:
    """What the checks share while they walk the jobs: who already holds which name, GPU, run dir and port."""

    spec: PlanSpec
    extra_overrides: Sequence[str]
    resume: str | None
    cwd: Path
    base: Mapping[str, str]
    inventory: GpuInventory
    problems: list[UserError] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    gpu_owner: dict[int, str] = field(default_factory=dict)
    dir_owner: dict[Path, str] = field(default_factory=dict)
    ports_taken: set[int] = field(default_factory=set)


def build_plan(
    spec: PlanSpec,
    *,
    extra_overrides: Sequence[str] = (),
    resume: str | None = None,
    cwd: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    inventory: GpuInventory | None = None,
) -> LaunchPlan:
    """Resolve and check ``spec`` without starting anything; problems are collected in ``plan.problems``.

    ``extra_overrides`` apply to every job (after the plan's own); ``resume``
    (``"auto"`` or a path) replaces every job's ``resume``. Each job goes
    through the checks in :func:`_plan_job`, one function per thing checked.
    """
    ctx = _Planning(
        spec,
        extra_overrides,
        resume,
        Path(cwd or os.getcwd()).resolve(),
        dict(os.environ if environ is None else environ),
        inventory or gpu_inventory(details=False),
    )
    jobs = [job for job in (_plan_job(spec_job, ctx) for spec_job in spec.jobs) if job is not None]
    if shutil.which("bash") is None:
        ctx.problems.append(
            ConfigError("bash is not installed; pointforge launch runs each job through a small bash script")
        )
    return LaunchPlan(jobs, ctx.inventory, spec.session, ctx.cwd, spec.source, ctx.problems)


def _plan_job(job: JobSpec, ctx: _Planning) -> JobPlan | None:
    """One job through every check; its problems go to ``ctx.problems`` (None: not planned at all)."""
    if not _check_name(job, ctx):
        return None
    notes: list[str] = []
    nproc, device, visible = _check_gpus(job, ctx, notes)
    run_dir = _check_run_dir(job, ctx)
    overrides, config_path = _check_config(job, ctx, run_dir, nproc, device, notes)
    resume = _check_resume(job, ctx, run_dir, notes)
    port = _check_port(job, ctx)
    worker = worker_args(job.task, config=config_path, overrides=[*overrides, f"run.dir={run_dir}"], resume=resume)
    command = torchrun_command(
        worker, nproc=nproc, max_restarts=job.max_restarts, endpoint=f"localhost:{port}", run_id=job.name
    )
    env_set = {
        "CUDA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTHONPATH": worker_pythonpath(ctx.base.get("PYTHONPATH")),
        "PYTHONUNBUFFERED": "1",
        **ctx.spec.env,
        **job.env,
    }
    env_unset = sorted(k for k in ctx.base if is_stripped(k) and k not in env_set)
    return JobPlan(
        job, run_dir, nproc, device, visible, port, command, env_set, env_unset, resume, config_path, overrides, notes
    )


def _check_name(job: JobSpec, ctx: _Planning) -> bool:
    if job.name in ctx.names:
        ctx.problems.append(ConfigError(f"two jobs are named {job.name}; give each job its own name"))
        return False
    ctx.names.add(job.name)
    return True


def _check_gpus(job: JobSpec, ctx: _Planning, notes: list[str]) -> tuple[int, str, str]:
    """GPUs exist, are not shared, one process each; returns (nproc, device, CUDA_VISIBLE_DEVICES)."""
    where, inventory = f"job {job.name}", ctx.inventory
    if not job.gpus:
        return job.nproc or int(job.cpu or 1), "cpu", ""
    missing = [g for g in job.gpus if g >= inventory.count]
    if missing:
        if inventory.count == 0:
            have = f"no GPUs (no NVIDIA driver, NVML or nvidia-smi found); use cpu: N for a CPU job, or set {FAKE_GPUS_ENV}=N to rehearse the plan"
        else:
            source = f"{FAKE_GPUS_ENV}={inventory.count}" if inventory.fake else f"from {inventory.source}"
            have = f"GPUs 0-{inventory.count - 1} ({source}); number GPUs as nvidia-smi does"
        ctx.problems.append(DeviceError(f"{where} asks for GPU {format_gpu_list(missing)} but this machine has {have}"))
    for g in job.gpus:
        if g in ctx.gpu_owner:
            ctx.problems.append(
                ConfigError(f"jobs {ctx.gpu_owner[g]} and {job.name} both use GPU {g}; give each job its own GPUs")
            )
        else:
            ctx.gpu_owner[g] = job.name
    nproc = job.nproc or len(job.gpus)
    if nproc > len(job.gpus):
        ctx.problems.append(
            DeviceError(
                f"{where}: nproc {nproc} needs {nproc} GPUs but the job has {len(job.gpus)} ({format_gpu_list(job.gpus)}); "
                "each process takes one GPU: lower nproc or add GPUs"
            )
        )
    elif nproc < len(job.gpus):
        notes.append(f"nproc {nproc} < {len(job.gpus)} GPUs: GPU(s) {format_gpu_list(job.gpus[nproc:])} stay idle")
    return nproc, "cpu" if inventory.fake else "cuda", ",".join(str(g) for g in job.gpus)


def _check_run_dir(job: JobSpec, ctx: _Planning) -> Path:
    """Absolute, not shared with another job, not in use by a live job."""
    where = f"job {job.name}"
    if any(_override_key(o) == "run.dir" for o in [*job.overrides, *ctx.extra_overrides]):
        ctx.problems.append(
            ConfigError(
                f"{where}: set the run directory with run_dir in the plan (or --runs-dir), not a run.dir override"
            )
        )
    run_dir = job_run_dir(job, ctx.spec.runs_dir, ctx.cwd)
    if run_dir in ctx.dir_owner:
        ctx.problems.append(
            ConfigError(
                f"jobs {ctx.dir_owner[run_dir]} and {job.name} both write to {run_dir}; give each job its own run_dir"
            )
        )
    ctx.dir_owner.setdefault(run_dir, job.name)
    state = run_state(run_dir, with_disk=False)
    locked = check_run_dir_lock(run_dir)
    if not locked.ok:
        # A training process holds the run dir (started by launch, train or torchrun): the same line train prints.
        ctx.problems.append(locked.error(f"{where}: {locked.problem}"))
    elif is_live(state):
        pid = state.job_pid or state.pid
        ctx.problems.append(
            RunDirInUse(
                f"{where}: run dir {run_dir} is in use by a live job ({state.status}, pid {pid}); "
                f"stop it first (pointforge launch --stop {state.name}) or choose another run_dir"
            )
        )
    return run_dir


def _check_config(
    job: JobSpec, ctx: _Planning, run_dir: Path, nproc: int, device: str, notes: list[str]
) -> tuple[list[str], Path | None]:
    """The config loads, fits the job's devices and splits its batch over ``nproc``; returns (overrides, config path)."""
    where = f"job {job.name}"
    overrides = [*job.overrides, *ctx.extra_overrides]
    device_keys = [o for o in overrides if _override_key(o) == "run.device"]
    if device == "cpu":
        overrides.append("run.device=cpu")
        if job.gpus:
            notes.append("faked GPUs: the job's processes run on the CPU (run.device=cpu, gloo)")
    config_path = None
    try:
        config_path = job_config_path(job, ctx.cwd)
        cfg = load_train_config(job.task, config_path, [*overrides, f"run.dir={run_dir}"])
    except UserError as err:
        ctx.problems.append(_as(err, where))
        return overrides, config_path
    wanted = cfg.run.device.strip().lower()
    if device == "cpu" and any(k.split("=", 1)[1].strip().lower() not in ("cpu", "auto") for k in device_keys):
        ctx.problems.append(
            ConfigError(
                f"{where} runs on the CPU ({'faked GPUs' if job.gpus else 'cpu job'}) but overrides {device_keys[-1]}; drop that override"
            )
        )
    elif device == "cuda" and wanted not in ("auto", "cuda"):
        ctx.problems.append(
            DeviceError(
                f"{where}: run.device={cfg.run.device} pins a device, but the job's GPUs are cuda:0 … cuda:{len(job.gpus) - 1} "
                "(each process takes cuda:LOCAL_RANK); use run.device=auto and choose GPUs with gpus:"
            )
        )
    try:
        batch = plan_batches(cfg.data.global_batch, nproc, cfg.data.micro_batch)
    except UserError as err:
        ctx.problems.append(_as(err, where))
        return overrides, config_path
    for finding in (
        check_compile(get_task(job.task), cfg.perf.compile),
        _check_memory(job, cfg, batch.micro_batch, device),
    ):
        if not finding.ok:
            ctx.problems.append(finding.error(f"{where}: {finding.problem}"))
    return overrides, config_path


def _check_memory(job: JobSpec, cfg: Any, micro_batch: int, device: str) -> Finding:
    """The task's own estimate of a training step against the job's first device (the engine asks the same)."""
    target = torch.device("cuda", job.gpus[0]) if device == "cuda" and job.gpus else torch.device("cpu")
    return check_memory(get_task(job.task), cfg.task, micro_batch, target, global_batch=cfg.data.global_batch)


def job_config_path(job: JobSpec, cwd: Path) -> Path | None:
    """The job's config as an absolute file: a file under ``cwd`` as it is, a bare preset name as the packaged YAML."""
    if not job.config:
        return None
    path = absolute(job.config, cwd)
    # The name is resolved first: made absolute, `paper` would look like a path to a missing file.
    return path if path.is_file() else absolute(resolve_config_path(job.task, job.config), cwd)


def _check_resume(job: JobSpec, ctx: _Planning, run_dir: Path, notes: list[str]) -> str | None:
    """Existing checkpoints are continued only when asked; a named checkpoint exists."""
    where = f"job {job.name}"
    resume = ctx.resume if ctx.resume is not None else job.resume
    if resume in ("none", ""):
        resume = None
    earlier = check_existing_checkpoints(run_dir, resume)
    if not earlier.ok:
        # The finding as train says it; the fix in a plan's words (resume: and run_dir are plan keys).
        ctx.problems.append(
            CheckpointError(
                f"{where}: {earlier.detail}; "
                "add --resume auto (or resume: auto in the plan) to continue it, or choose a new run_dir"
            )
        )
    elif resume == "auto":
        existing = ckpt_io.resume_candidates(run_dir)
        notes.append(f"continues from {existing[0]}" if existing else "no checkpoint yet: starts from scratch")
    elif resume is not None:
        ck = absolute(resume, ctx.cwd)
        if not ck.is_file():
            ctx.problems.append(
                CheckpointError(f"{where}: resume checkpoint {ck} does not exist; check the path or use --resume auto")
            )
        resume = str(ck)
    return resume


def _check_port(job: JobSpec, ctx: _Planning) -> int:
    """The plan's port (free, not given twice), or a free one."""
    where = f"job {job.name}"
    if job.port is not None:
        port = job.port
        if port in ctx.ports_taken:
            ctx.problems.append(
                ConfigError(f"{where}: port {port} is given to two jobs; give each job its own port, or leave port out")
            )
        elif not port_free(port):
            owner = port_owner(port)
            by = f" (by pid {owner})" if owner else ""
            ctx.problems.append(
                ConfigError(
                    f"{where}: rendezvous port {port} is in use{by}; choose another port, or leave port out and a free one is picked"
                )
            )
    else:
        port = pick_free_port(ctx.ports_taken | {j.port for j in ctx.spec.jobs if j.port})
    ctx.ports_taken.add(port)
    return port

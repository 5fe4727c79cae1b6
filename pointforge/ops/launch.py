"""``pointforge launch``: several training jobs on one machine, each on its own GPUs.

A plan (a YAML file, or ``--job NAME:TASK:GPUS[:CONFIG]`` flags) names jobs;
each gets

* its own GPUs: ``CUDA_VISIBLE_DEVICES`` set to its *physical* GPUs (the
  numbers nvidia-smi shows; ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA agree),
  so inside the job they are ``cuda:0 … cuda:k-1``, one process per GPU;
* its own rendezvous port, chosen free (or the plan's, checked free) and passed
  to torchrun as ``--rdzv-endpoint localhost:PORT``;
* its own run directory, log (``console.log`` beside the engine's ``train.log``)
  and environment: built afresh from this shell's for every job, with every
  variable a launcher or another job could leak (``CUDA_VISIBLE_DEVICES``,
  ``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``, ...) removed first.

Everything is checked before anything starts, and the whole plan is refused
on the first look if two jobs share a GPU, a GPU does not exist, a port is in
use, a run directory is in use by a live job, a config does not load, or a
batch does not split over the job's GPUs.

The exact command and environment of each job are written to
``RUN_DIR/launch.sh`` (the script the job runs; re-run it by hand to restart
the job the same way) and ``RUN_DIR/launch.json`` (read by ``monitor`` and
``--stop``); the job's torchrun pid goes to ``RUN_DIR/launch.pid``.

Jobs run detached (a process session of their own, so closing the terminal
does not end them) or, with ``--tmux``, in a tmux session with a window per job
and one running ``pointforge monitor``. ``stop_jobs`` stops jobs the way the
engine wants: SIGTERM to the worker processes (listed in ``RUN_DIR/ranks/``),
which finish their step, write a checkpoint and exit 0.

``POINTFORGE_FAKE_GPUS=N`` plans for N GPUs on a machine without them; each
job then runs its processes on the CPU (``run.device=cpu``, gloo), so the whole
path can be rehearsed and tested anywhere.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from pointforge.atomic import atomic_write_json, atomic_write_text
from pointforge.config.loader import load_yaml
from pointforge.errors import CheckpointError, ConfigError, DeviceError, UserError
from pointforge.ops.host import (
    FAKE_GPUS_ENV,
    GpuInventory,
    format_gpu_list,
    gpu_inventory,
    parse_gpu_list,
    pick_free_port,
    port_free,
    port_owner,
    this_host,
)
from pointforge.ops.runs import (
    CONSOLE_LOG,
    LAUNCH_JSON,
    LAUNCH_PID,
    LAUNCH_SH,
    find_run_dirs,
    is_live,
    live_workers,
    read_launch,
    run_state,
)
from pointforge.tasks.configs import load_train_config
from pointforge.train import checkpoint as ckpt_io
from pointforge.train.launch import package_root, pid_alive, torchrun_command, worker_args, worker_pythonpath  # noqa: F401
from pointforge.train.lock import RunDirInUse, in_use_message, lock_holder
from pointforge.train.schedule import plan_batches

DEFAULT_RUNS_DIR = "runs"
DEFAULT_SESSION = "pointforge"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PLAN_KEYS = ("runs_dir", "env", "jobs", "session")
_JOB_KEYS = (
    "name",
    "task",
    "config",
    "gpus",
    "cpu",
    "nproc",
    "overrides",
    "run_dir",
    "env",
    "port",
    "resume",
    "max_restarts",
)

# Variables a job must never inherit: from this shell, from a tmux server
# started long ago, or from another job. Each job gets its own values.
_STRIPPED = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    FAKE_GPUS_ENV,
)
_STRIPPED_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "PET_")


# --------------------------------------------------------------------------- the plan as written


@dataclass
class JobSpec:
    """One job as the plan file (or a ``--job`` flag) states it."""

    name: str
    task: str
    config: str | None = None
    gpus: list[int] = field(default_factory=list)  # physical GPUs; empty for a CPU job
    cpu: int | None = None  # CPU processes, for a job without GPUs
    nproc: int | None = None  # defaults to len(gpus)
    overrides: list[str] = field(default_factory=list)
    run_dir: str | None = None  # defaults to RUNS_DIR/NAME
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None  # rendezvous port; a free one is picked when absent
    resume: str | None = None  # None, "auto" or a checkpoint path
    max_restarts: int = 0


@dataclass
class PlanSpec:
    jobs: list[JobSpec]
    runs_dir: str = DEFAULT_RUNS_DIR
    env: dict[str, str] = field(default_factory=dict)  # added to every job's environment
    session: str = DEFAULT_SESSION  # tmux session name
    source: Path | None = None


def _check_keys(data: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{where}: unknown key '{key}'; {hint}valid keys: {', '.join(allowed)}")


def _env_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: env must be a mapping of NAME: value")
    out = {}
    for key, val in value.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", str(key)):
            raise ConfigError(f"{where}: {key!r} is not an environment variable name")
        name = str(key)
        if name in _STRIPPED or name.startswith(_STRIPPED_PREFIXES):
            raise ConfigError(
                f"{where}: env may not set {name}; pointforge launch sets it for each job "
                "(choose GPUs with gpus:, ports with port:)"
            )
        out[name] = "" if val is None else str(val).lower() if isinstance(val, bool) else str(val)
    return out


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{where} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{where} must be a whole number, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{where} must be at least {minimum}, got {number}")
    return number


def job_from_mapping(data: Mapping[str, Any], where: str) -> JobSpec:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: a job is a mapping with name, task, gpus (or cpu), config, ...")
    _check_keys(data, _JOB_KEYS, where)
    for key in ("name", "task"):
        if not data.get(key):
            raise ConfigError(f"{where}: '{key}' is required")
    name = str(data["name"])
    where = f"job {name}"
    if not _NAME.match(name):
        raise ConfigError(
            f"{where}: the name may use letters, digits, '.', '_' and '-' (it names a folder and a tmux window)"
        )
    has_gpus, has_cpu = data.get("gpus") is not None, data.get("cpu") is not None
    if has_gpus == has_cpu:
        raise ConfigError(
            f'{where}: give either gpus (e.g. "0-6") or cpu (a number of CPU processes), not {"both" if has_gpus else "neither"}'
        )
    overrides = data.get("overrides") or []
    if isinstance(overrides, str):
        overrides = overrides.split()
    if not isinstance(overrides, list) or not all(isinstance(o, (str, int, float)) for o in overrides):
        raise ConfigError(f"{where}: overrides must be a list of key=value strings")
    resume = data.get("resume")
    return JobSpec(
        name=name,
        task=str(data["task"]),
        config=str(data["config"]) if data.get("config") else None,
        gpus=parse_gpu_list(data["gpus"], where) if has_gpus else [],
        cpu=_int(data["cpu"], f"{where}: cpu", 1) if has_cpu else None,
        nproc=_int(data["nproc"], f"{where}: nproc", 1) if data.get("nproc") is not None else None,
        overrides=[str(o) for o in overrides],
        run_dir=str(data["run_dir"]) if data.get("run_dir") else None,
        env=_env_map(data.get("env"), where),
        port=_int(data["port"], f"{where}: port", 1) if data.get("port") is not None else None,
        resume=None if resume in (None, False, "none", "") else str(resume),
        max_restarts=_int(data.get("max_restarts", 0), f"{where}: max_restarts", 0),
    )


def load_plan(path: str | os.PathLike) -> PlanSpec:
    """Read a plan file (ConfigError for a missing file, bad YAML or a wrong key)."""
    path = Path(path)
    data = load_yaml(path)
    where = f"plan {path}"
    _check_keys(data, _PLAN_KEYS, where)
    jobs = data.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise ConfigError(f"{where}: 'jobs' must be a non-empty list of jobs (name, task, gpus, config, ...)")
    return PlanSpec(
        jobs=[job_from_mapping(job, f"{where}, job {i + 1}") for i, job in enumerate(jobs)],
        runs_dir=str(data.get("runs_dir") or DEFAULT_RUNS_DIR),
        env=_env_map(data.get("env"), where),
        session=str(data.get("session") or DEFAULT_SESSION),
        source=path,
    )


def parse_job_flag(text: str) -> JobSpec:
    """``NAME:TASK:GPUS[:CONFIG]``, GPUS like ``0-6``, ``7``, ``0,2`` or ``cpu``/``cpu4`` (CPU processes)."""
    parts = text.split(":", 3)
    if len(parts) < 3 or not all(parts[:3]):
        raise ConfigError(
            f"--job {text!r}: write NAME:TASK:GPUS[:CONFIG], e.g. --job pcdiff:pcdiff:0-6:pointforge/configs/pcdiff/paper.yaml"
        )
    name, task, gpus = parts[:3]
    data: dict[str, Any] = {"name": name, "task": task}
    match = re.fullmatch(r"cpu(\d*)", gpus.strip().lower())
    if match:
        data["cpu"] = int(match.group(1) or 1)
    else:
        data["gpus"] = gpus
    if len(parts) == 4 and parts[3]:
        data["config"] = parts[3]
    return job_from_mapping(data, f"--job {text!r}")


# --------------------------------------------------------------------------- the plan, resolved


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
        env = {k: v for k, v in base.items() if not _stripped(k)}
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
        if not self.problems:
            return
        if len(self.problems) == 1:
            raise self.problems[0]
        kinds = {type(p) for p in self.problems}
        cls = kinds.pop() if len(kinds) == 1 else ConfigError
        raise cls(
            f"plan refused, nothing started ({len(self.problems)} problems): "
            + "; ".join(str(p) for p in self.problems)
        )

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


def _stripped(name: str) -> bool:
    return name in _STRIPPED or name.startswith(_STRIPPED_PREFIXES)


def _abs(path: str | os.PathLike, cwd: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (cwd / p)


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
    env_unset = sorted(k for k in ctx.base if _stripped(k) and k not in env_set)
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
    run_dir = _abs(job.run_dir, ctx.cwd) if job.run_dir else _abs(ctx.spec.runs_dir, ctx.cwd) / job.name
    run_dir = Path(os.path.normpath(run_dir))
    if run_dir in ctx.dir_owner:
        ctx.problems.append(
            ConfigError(
                f"jobs {ctx.dir_owner[run_dir]} and {job.name} both write to {run_dir}; give each job its own run_dir"
            )
        )
    ctx.dir_owner.setdefault(run_dir, job.name)
    state = run_state(run_dir, with_disk=False)
    holder = lock_holder(run_dir)
    if holder is not None:
        # A training process holds the run dir (started by launch, train or torchrun): the same line train prints.
        ctx.problems.append(RunDirInUse(f"{where}: {in_use_message(run_dir, holder)}"))
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
    config_path = _abs(job.config, ctx.cwd) if job.config else None
    try:
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
        plan_batches(cfg.data.global_batch, nproc, cfg.data.micro_batch)
    except UserError as err:
        ctx.problems.append(_as(err, where))
    return overrides, config_path


def _check_resume(job: JobSpec, ctx: _Planning, run_dir: Path, notes: list[str]) -> str | None:
    """Existing checkpoints are continued only when asked; a named checkpoint exists."""
    where = f"job {job.name}"
    resume = ctx.resume if ctx.resume is not None else job.resume
    if resume in ("none", ""):
        resume = None
    existing = ckpt_io.resume_candidates(run_dir)
    if resume is None and existing:
        ctx.problems.append(
            CheckpointError(
                f"{where}: run dir {run_dir} already holds checkpoints ({existing[0].name}, ...); "
                "add --resume auto (or resume: auto in the plan) to continue it, or choose a new run_dir"
            )
        )
    elif resume == "auto":
        notes.append(f"continues from {existing[0]}" if existing else "no checkpoint yet: starts from scratch")
    elif resume is not None:
        ck = _abs(resume, ctx.cwd)
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


# --------------------------------------------------------------------------- starting


def job_script(job: JobPlan, cwd: Path) -> str:
    """The bash script a job runs: its own environment, then ``exec torchrun`` (same pid)."""
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        f"# pointforge launch: job {job.name}. Run it again to start the job the same way",
        "# (add --resume auto to the command once the run dir holds checkpoints).",
        f"cd {q(str(cwd))} || exit 1",
        "unset " + " ".join(_STRIPPED),
        "for name in $(compgen -e); do case $name in "
        + "|".join(f"{p}*" for p in _STRIPPED_PREFIXES)
        + ') unset "$name";; esac; done',
    ]
    lines += [f"export {k}={q(v)}" for k, v in job.env_set.items()]
    run_dir = q(str(job.run_dir))
    lines += [
        f"mkdir -p {run_dir}",
        # Written before exec, so it is torchrun's pid; renamed into place, so never half-written.
        f"echo $$ > {run_dir}/.{LAUNCH_PID}.tmp && mv -f {run_dir}/.{LAUNCH_PID}.tmp {run_dir}/{LAUNCH_PID}",
        # In a terminal (tmux) show the output and keep it; detached, the launcher already sends it to the log.
        f"if [ -t 1 ]; then exec > >(tee -a {run_dir}/{CONSOLE_LOG}) 2>&1; fi",
        "exec " + shlex.join(job.command),
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Started:
    name: str
    run_dir: Path
    pid: int | None
    mode: str


def _tmux(args: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", *args], env=dict(env), capture_output=True, text=True, timeout=30)


def tmux_session_exists(session: str, env: Mapping[str, str] | None = None) -> bool:
    if shutil.which("tmux") is None:
        return False
    return _tmux(["has-session", "-t", f"={session}"], env or os.environ).returncode == 0


def start_plan(plan: LaunchPlan, *, tmux: bool = False, monitor_every: float = 10.0) -> list[Started]:
    """Start every job of a checked plan (detached, or in a tmux session); return where each runs.

    Raises the plan's problems before starting anything. If a job fails to
    start, the ones already started are stopped again.
    """
    plan.check()
    base = dict(os.environ)
    if tmux:
        _check_tmux(plan, base)
    started: list[Started] = []
    try:
        for index, job in enumerate(plan.jobs):
            script, with_pid = _write_job_files(plan, job, tmux)
            if tmux:
                started.append(_start_in_tmux(plan, job, index, script, base))
            else:
                started.append(_start_detached(plan, job, script, with_pid, base))
        if tmux:
            _open_monitor_window(plan, base, monitor_every)
            for item in started:
                item.pid = wait_for_pid(item.run_dir, timeout_s=30)
    except BaseException:
        for item in started:
            pid = item.pid or wait_for_pid(item.run_dir, timeout_s=2)
            if pid and pid_alive(pid):
                _signal(pid, signal.SIGTERM)
        raise
    return started


def _check_tmux(plan: LaunchPlan, base: dict[str, str]) -> None:
    if shutil.which("tmux") is None:
        raise ConfigError(
            "--tmux: tmux is not installed; install it (e.g. apt-get install tmux) or leave out --tmux to run the jobs detached"
        )
    if tmux_session_exists(plan.session, base):
        raise ConfigError(
            f"--tmux: a tmux session named {plan.session} already exists; close it (tmux kill-session -t {plan.session}) or pass --session NAME"
        )


def _write_job_files(plan: LaunchPlan, job, tmux: bool) -> tuple[Path, Path]:
    """The job's launch script and launch record in its run dir; the pid file path (cleared)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    script = job.run_dir / LAUNCH_SH
    atomic_write_text(script, job_script(job, plan.cwd))
    script.chmod(0o755)
    with_pid = job.run_dir / LAUNCH_PID
    with_pid.unlink(missing_ok=True)
    mode = "tmux" if tmux else "detached"
    atomic_write_json(
        job.run_dir / LAUNCH_JSON,
        job.record(mode=mode, session=plan.session if tmux else None, plan=plan.source, faked=plan.faked),
    )
    return script, with_pid


def _start_in_tmux(plan: LaunchPlan, job, index: int, script: Path, base: dict[str, str]) -> Started:
    window = ["-n", job.name, "-c", str(plan.cwd), f"bash {shlex.quote(str(script))}"]
    first = ["new-session", "-d", "-s", plan.session] if index == 0 else ["new-window", "-d", "-t", f"={plan.session}:"]
    # In one tmux command, so the window cannot end before it is told to stay open.
    result = _tmux(
        [
            *first,
            *window,
            ";",
            "set-window-option",
            "-t",
            f"={plan.session}:{job.name}",
            "remain-on-exit",
            "on",
        ],
        base,
    )
    if result.returncode != 0:
        raise ConfigError(f"tmux could not start job {job.name}: {result.stderr.strip() or result.stdout.strip()}")
    return Started(job.name, job.run_dir, None, "tmux")


def _start_detached(plan: LaunchPlan, job, script: Path, with_pid: Path, base: dict[str, str]) -> Started:
    with open(job.run_dir / CONSOLE_LOG, "ab") as log:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=str(plan.cwd),
            env=base,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # The script records the same pid (it execs torchrun); writing it now
    # leaves no moment in which the job looks gone.
    atomic_write_text(with_pid, f"{proc.pid}\n", durable=False)
    return Started(job.name, job.run_dir, proc.pid, "detached")


def _open_monitor_window(plan: LaunchPlan, base: dict[str, str], monitor_every: float) -> None:
    dirs = " ".join(shlex.quote(str(j.run_dir)) for j in plan.jobs)
    monitor = (
        f"env PYTHONPATH={shlex.quote(plan.jobs[0].env_set['PYTHONPATH'])} {shlex.quote(sys.executable)} "
        f"-m pointforge.cli.monitor {dirs} --watch {monitor_every:g}"
    )
    result = _tmux(
        [
            "new-window",
            "-d",
            "-t",
            f"={plan.session}:",
            "-n",
            "monitor",
            "-c",
            str(plan.cwd),
            monitor,
            ";",
            "set-window-option",
            "-t",
            f"={plan.session}:monitor",
            "remain-on-exit",
            "on",
        ],
        base,
    )
    if result.returncode != 0:
        raise ConfigError(f"tmux could not open the monitor window: {result.stderr.strip()}")


def wait_for_pid(run_dir: Path, timeout_s: float) -> int | None:
    end = time.monotonic() + timeout_s
    while True:
        record = read_launch(run_dir)
        if record and record.get("pid"):
            return int(record["pid"])
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def launch(
    spec: PlanSpec,
    *,
    extra_overrides: Sequence[str] = (),
    resume: str | None = None,
    tmux: bool = False,
    dry_run: bool = False,
) -> tuple[LaunchPlan, list[Started]]:
    """Plan, check and (unless ``dry_run``) start the jobs of ``spec``."""
    plan = build_plan(spec, extra_overrides=extra_overrides, resume=resume)
    if dry_run:
        plan.check()
        return plan, []
    return plan, start_plan(plan, tmux=tmux)


# --------------------------------------------------------------------------- stopping


@dataclass
class JobRef:
    name: str
    run_dir: Path


def jobs_in(
    spec: PlanSpec | None = None, runs_dirs: Iterable[str | os.PathLike] = (), *, cwd: str | os.PathLike | None = None
) -> list[JobRef]:
    """The launched jobs named by a plan, or found (by their launch.json) under ``runs_dirs``."""
    cwd = Path(cwd or os.getcwd()).resolve()
    refs: list[JobRef] = []
    if spec is not None:
        for job in spec.jobs:
            run_dir = _abs(job.run_dir, cwd) if job.run_dir else _abs(spec.runs_dir, cwd) / job.name
            refs.append(JobRef(job.name, Path(os.path.normpath(run_dir))))
    for root in runs_dirs:
        for run_dir in find_run_dirs(_abs(root, cwd)):
            record = read_launch(run_dir)
            if record is not None:
                refs.append(JobRef(str(record.get("name") or run_dir.name), run_dir))
    return refs


@dataclass
class StopResult:
    name: str
    run_dir: Path
    action: str  # "signalled", "killed", "not running"
    message: str
    status: str | None = None  # the run's status after waiting


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_job(ref: JobRef, *, now: bool = False) -> StopResult:
    """Ask one job to stop: SIGTERM to its workers (checkpoint, exit 0); ``now`` kills it at once."""
    record = read_launch(ref.run_dir)
    state = run_state(ref.run_dir, with_disk=False)
    if record is None:
        return StopResult(
            ref.name,
            ref.run_dir,
            "not running",
            f"{ref.name}: {ref.run_dir} was not started by pointforge launch (no {LAUNCH_JSON})",
        )
    if record.get("host") != this_host():
        return StopResult(
            ref.name, ref.run_dir, "not running", f"{ref.name}: runs on host {record.get('host')}; stop it there"
        )
    if not is_live(state):
        return StopResult(
            ref.name,
            ref.run_dir,
            "not running",
            f"{ref.name}: not running ({state.status if state else 'no status'})",
            state.status if state else None,
        )
    job_pid = record.get("pid")
    workers = live_workers(ref.run_dir, since=float(record.get("launched_at") or 0.0))
    if now:
        for pid in workers:
            _signal(pid, signal.SIGKILL)
        if job_pid and pid_alive(job_pid):
            _signal(int(job_pid), signal.SIGTERM)
        return StopResult(
            ref.name,
            ref.run_dir,
            "killed",
            f"{ref.name}: killed {len(workers)} worker(s) and torchrun; no checkpoint was written",
        )
    if workers:
        for pid in workers:
            _signal(pid, signal.SIGTERM)
        return StopResult(
            ref.name,
            ref.run_dir,
            "signalled",
            f"{ref.name}: asked {len(workers)} worker(s) to finish the step, write a checkpoint and exit",
        )
    if job_pid and pid_alive(job_pid):
        # No worker has registered yet: nothing to save, so end torchrun (it ends its workers).
        _signal(int(job_pid), signal.SIGTERM)
        return StopResult(ref.name, ref.run_dir, "signalled", f"{ref.name}: had not started training yet; stopped it")
    return StopResult(ref.name, ref.run_dir, "not running", f"{ref.name}: not running")


def stop_jobs(
    refs: Sequence[JobRef],
    which: str,
    *,
    now: bool = False,
    wait_s: float = 0.0,
    on_result: Callable[[StopResult], None] | None = None,
) -> list[StopResult]:
    """Stop the job named ``which`` (or ``all``) among ``refs``; wait up to ``wait_s`` for them to end."""
    if not refs:
        raise ConfigError("no launched jobs found; give the plan file or --runs-dir where the jobs' run dirs are")
    chosen = list(refs) if which == "all" else [r for r in refs if r.name == which]
    if not chosen:
        names = ", ".join(sorted({r.name for r in refs}))
        raise ConfigError(f"no job named {which}; jobs: {names} (or all)")
    results = [stop_job(ref, now=now) for ref in chosen]
    for result in results:
        if on_result is not None:
            on_result(result)
    pending = [r for r in results if r.action != "not running"]
    end = time.monotonic() + wait_s
    while pending and time.monotonic() < end:
        time.sleep(0.2)
        still = []
        for result in pending:
            record = read_launch(result.run_dir) or {}
            if pid_alive(record.get("pid")):
                still.append(result)
                continue
            state = run_state(result.run_dir, with_disk=False)
            result.status = state.status if state else None
            if state is not None and state.status == "stopped":
                result.message = f"{result.name}: stopped at step {state.step}; checkpoint {state.last_checkpoint}"
            else:
                result.message = f"{result.name}: ended ({result.status})"
        pending = still
    for result in pending:
        result.message = f"{result.name}: still running after {wait_s:g} s (a step or checkpoint may be long); run --stop again with --now to end it at once"
    return results

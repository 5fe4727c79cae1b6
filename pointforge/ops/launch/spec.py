"""The launch plan as written: the schema, a plan file or ``--job`` flags parsed, every key checked.

Nothing here looks at the machine: :mod:`pointforge.ops.launch.plan` resolves
and checks a :class:`PlanSpec` against it.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from pointforge.config.loader import load_yaml
from pointforge.errors import ConfigError
from pointforge.ops.host import FAKE_GPUS_ENV, parse_gpu_list

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
STRIPPED = (
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
STRIPPED_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "PET_")


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
        if is_stripped(name):
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
        raise ConfigError(f"--job {text!r}: write NAME:TASK:GPUS[:CONFIG], e.g. --job pcdiff:pcdiff:0-6:paper")
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


def is_stripped(name: str) -> bool:
    """Whether ``name`` is a variable each job gets its own value of (never inherited)."""
    return name in STRIPPED or name.startswith(STRIPPED_PREFIXES)


def absolute(path: str | os.PathLike, cwd: Path) -> Path:
    """``path`` (``~`` expanded) as an absolute path, relative ones taken from ``cwd``."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (cwd / p)


def job_run_dir(job: JobSpec, runs_dir: str | os.PathLike, cwd: Path) -> Path:
    """Where ``job`` writes: its own ``run_dir``, else ``RUNS_DIR/NAME``; absolute and normalised."""
    run_dir = absolute(job.run_dir, cwd) if job.run_dir else absolute(runs_dir, cwd) / job.name
    return Path(os.path.normpath(run_dir))

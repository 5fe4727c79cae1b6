"""Plan a launch plan's jobs for Slurm, check everything checkable, write the scripts and submit them.

The same plan as ``pointforge launch`` (a plan file or ``--job`` flags, parsed
by :mod:`pointforge.ops.launch.spec`), read per node: a job's ``gpus`` are
counted (``0-3``: four GPUs on every node; Slurm picks which) and ``cpu: N``
runs N CPU processes per node. Refused before anything is submitted, every
problem at once (one line each, as ``pointforge launch`` refuses a plan): no
``sbatch``; a config that does not load (a typo); a global batch that nodes ×
processes per node does not divide; a run dir that is not on a shared
filesystem (every node must read and write it); a run dir in use or with an
earlier run's checkpoints that were not asked to be continued.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pointforge.atomic import atomic_write_json, atomic_write_text
from pointforge.errors import CheckpointError, ConfigError, UserError, raise_problems
from pointforge.ops.launch.plan import job_config_path
from pointforge.ops.launch.spec import JobSpec, PlanSpec, job_run_dir
from pointforge.ops.slurm.queue import JOB_PREFIX, RECORD_NAME
from pointforge.ops.slurm.script import ENDPOINT, NNODES, RUN_ID, SlurmScript, sbatch_script
from pointforge.tasks.configs import load_train_config
from pointforge.train.preflight import check_existing_checkpoints, check_run_dir_lock
from pointforge.train.schedule import BatchPlan, plan_batches, scale_lr
from pointforge.train.torchrun import torchrun_command, worker_args, worker_pythonpath

SCRIPT_NAME = "slurm.sbatch"
# Filesystems every node of a cluster mounts alike. Anything else (ext4, xfs,
# tmpfs, overlay, ...) is taken as local to the machine that submits.
SHARED_FILESYSTEMS = frozenset(
    "nfs nfs4 lustre gpfs beegfs cifs smb3 ceph fuse.ceph glusterfs fuse.glusterfs panfs wekafs "
    "orangefs pvfs2 fuse.juicefs fuse.sshfs afs".split()
)


@dataclass
class SlurmOptions:
    """The cluster's side of a submission (``launch --slurm`` flags)."""

    nodes: int = 1
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    signal_before_s: int = 120
    gres_name: str = "gpu"
    cpus_per_task: int | None = None
    allow_local_run_dir: bool = False
    extra_sbatch: list[str] = field(default_factory=list)


@dataclass
class SlurmJob:
    """One job planned for Slurm: its run dir, batch plan, LR and script."""

    name: str
    task: str
    run_dir: Path
    per_node: int
    device: str
    batch: BatchPlan
    lr: float
    lr_scaled: float
    lr_scaling: str
    script: str
    filesystem: str

    def lines(self, nodes: int) -> list[str]:
        b = self.batch
        accumulate = f", {b.accumulation} micro-batches of {b.micro_batch}" if b.accumulation > 1 else ""
        lr = (
            f"{self.lr:g}"
            if self.lr_scaling == "none"
            else f"{self.lr:g}, {self.lr_scaling} scaling → {self.lr_scaled:g}"
        )
        return [
            f"job {self.name}  (task {self.task}) on Slurm",
            f"  run dir        {self.run_dir} ({self.filesystem})",
            f"  processes      {nodes} node(s) × {self.per_node} per node = {b.world_size} ({self.device})",
            f"  global batch   {b.global_batch}: {b.global_batch // b.world_size} per process{accumulate}",
            f"  learning rate  {lr} (scaled once, for the global batch; the same on any node count)",
            f"  script         {self.run_dir / SCRIPT_NAME}",
        ]


def filesystem_of(path: Path) -> tuple[str, str]:
    """(filesystem type, mount point) of the mount holding ``path`` (its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    real = os.path.realpath(probe)
    best = ("unknown", "/")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[1]):
            best = (parts[2], point)
    return best


def check_shared(run_dir: Path, allow_local: bool) -> str:
    """The run dir's filesystem, described; ConfigError when it is not one every node can see."""
    fstype, point = filesystem_of(run_dir)
    described = f"{fstype} at {point}"
    if allow_local:
        return f"{described}, taken as shared (--allow-local-run-dir)"
    if fstype not in SHARED_FILESYSTEMS or str(run_dir).startswith(("/tmp/", "/dev/shm/")):
        raise ConfigError(
            f"run dir {run_dir} is on {described}, not a shared filesystem the nodes all see; "
            "put it on the cluster's shared storage (NFS, Lustre, GPFS, BeeGFS, ...) with --runs-dir, "
            "or pass --allow-local-run-dir if every node mounts it"
        )
    return described


def plan_slurm(
    spec: PlanSpec,
    options: SlurmOptions,
    *,
    extra_overrides: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
    require_sbatch: bool = True,
) -> list[SlurmJob]:
    """Every job of ``spec`` checked and scripted; every problem found raised at once, one line each
    (:func:`~pointforge.errors.raise_problems`, as ``pointforge launch`` refuses a plan), nothing submitted.

    ``require_sbatch=False`` (a dry run) scripts a plan where Slurm is not installed.
    """
    problems: list[UserError] = []
    if require_sbatch and shutil.which("sbatch") is None:
        problems.append(
            ConfigError("sbatch is not on PATH: submit from a Slurm login node (or load the cluster's slurm module)")
        )
    jobs: list[SlurmJob | None] = []
    if options.nodes < 1:
        problems.append(ConfigError(f"--nodes must be at least 1, got {options.nodes}"))
    else:
        base = Path(cwd or os.getcwd()).resolve()
        jobs = [_plan_job(job, spec, options, list(extra_overrides), base, problems) for job in spec.jobs]
    raise_problems(problems, "plan refused, nothing submitted")
    return [job for job in jobs if job is not None]


def _plan_job(
    job: JobSpec, spec: PlanSpec, options: SlurmOptions, extra: list[str], cwd: Path, problems: list[UserError]
) -> SlurmJob | None:
    """One job through every check; its problems go to ``problems`` (None: the job has some)."""
    where, found = f"job {job.name}", len(problems)
    per_node = job.nproc or (len(job.gpus) if job.gpus else int(job.cpu or 1))
    overrides = [*job.overrides, *extra, *([] if job.gpus else ["run.device=cpu"])]
    if any(o.split("=", 1)[0].strip() == "run.dir" for o in overrides):
        problems.append(
            ConfigError(f"{where}: set the run directory with run_dir in the plan (or --runs-dir), not run.dir")
        )
    run_dir = job_run_dir(job, spec.runs_dir, cwd)
    overrides = [*overrides, f"run.dir={run_dir}"]
    try:
        config = job_config_path(job, cwd)
        cfg = load_train_config(job.task, config, overrides)
        batch = plan_batches(cfg.data.global_batch, options.nodes * per_node, cfg.data.micro_batch)
    except UserError as err:
        problems.append(type(err)(f"{where}: {err}"))
    filesystem = _check_run_dir(where, run_dir, job.resume, options.allow_local_run_dir, problems)
    if len(problems) > found:
        return None
    worker = worker_args(job.task, config=config, overrides=overrides, resume="auto")
    return SlurmJob(
        job.name,
        job.task,
        run_dir,
        per_node,
        "cuda" if job.gpus else "cpu",
        batch,
        cfg.optim.lr,
        scale_lr(cfg.optim.lr, cfg.optim.lr_scaling, batch.global_batch, cfg.optim.base_batch),
        cfg.optim.lr_scaling,
        sbatch_script(_script(job, spec, options, worker, per_node, run_dir)),
        filesystem,
    )


def _check_run_dir(where: str, run_dir: Path, resume: str | None, allow_local: bool, problems: list[UserError]) -> str:
    """The run dir every node must see: shared, not in use, no earlier checkpoints unless resumed; its filesystem."""
    filesystem = ""
    try:
        filesystem = check_shared(run_dir, allow_local)
    except ConfigError as err:
        problems.append(err)
    locked = check_run_dir_lock(run_dir)
    if not locked.ok:
        problems.append(locked.error(f"{where}: {locked.problem}"))
    earlier = check_existing_checkpoints(run_dir, resume)
    if not earlier.ok:
        problems.append(
            CheckpointError(
                f"{where}: {earlier.detail}; add --resume auto (or resume: auto in the plan) to continue it, or choose a new run_dir"
            )
        )
    return filesystem


def _script(
    job: JobSpec, spec: PlanSpec, options: SlurmOptions, worker: list[str], per_node: int, run_dir: Path
) -> SlurmScript:
    """The sbatch script's settings: one torchrun agent per node running ``worker``."""
    torchrun = torchrun_command(
        worker, nproc=per_node, max_restarts=job.max_restarts, endpoint=ENDPOINT, run_id=RUN_ID, nnodes=NNODES
    )
    env = {
        "PYTHONPATH": worker_pythonpath(os.environ.get("PYTHONPATH")),
        "PYTHONUNBUFFERED": "1",
        **spec.env,
        **job.env,
    }
    return SlurmScript(
        name=f"{JOB_PREFIX}{job.name}",
        run_dir=str(run_dir),
        python=sys.executable,
        torchrun=torchrun,
        nodes=options.nodes,
        gpus_per_node=per_node if job.gpus else 0,
        cpus_per_task=options.cpus_per_task,
        partition=options.partition,
        account=options.account,
        time_limit=options.time_limit,
        signal_before_s=options.signal_before_s,
        gres_name=options.gres_name,
        port=job.port,
        env=env,
        extra_sbatch=list(options.extra_sbatch),
    )


def submit(job: SlurmJob, *, env: dict[str, str] | None = None) -> str:
    """Write the job's script into its run dir, ``sbatch`` it, record the job id; the id."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    script = job.run_dir / SCRIPT_NAME
    atomic_write_text(script, job.script)
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=str(job.run_dir),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"job {job.name}: sbatch refused it: {said[-1] if said else f'exit {done.returncode}'}")
    job_id = done.stdout.strip().split(";")[0]
    atomic_write_json(job.run_dir / RECORD_NAME, {"job_id": job_id, "name": job.name, "script": str(script)})
    return job_id

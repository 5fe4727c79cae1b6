"""``pointforge doctor``: check a machine, a config, a dataset and a checkpoint before a long run.

Each check ends in ``ok``, ``warning`` or ``failure`` with one line of detail
and, when it is not ok, one line saying what to do. :func:`run_doctor` runs
the checks that apply to what it is given (a config, a plan, a dataset root,
a resume checkpoint, a port, tmux) and returns a :class:`DoctorReport`; its
``failed`` property is what the command's exit status follows.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from pointforge.errors import UserError
from pointforge.formats import format_bytes
from pointforge.ops.host import GpuInventory, format_gpu_list, gpu_inventory, port_free, port_owner

OK, WARNING, FAILURE = "ok", "warning", "failure"
DEFAULT_PORT = 29500  # torchrun's default rendezvous/master port
# When a sample batch cannot be measured: what one batch in flight is assumed to take.
FALLBACK_BATCH_BYTES = 64 * 2**20
SAMPLE_FILES = 4


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _from_finding(finding: Any) -> Check:
    """A preflight :class:`~pointforge.train.preflight.Finding` as one line of the report."""
    return Check(finding.check, finding.status, finding.detail, finding.fix)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == FAILURE for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARNING, FAILURE)}

    def text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=10)
        lines = ["pointforge doctor"]
        for c in self.checks:
            lines.append(f"  {c.status:8s} {c.name:{width}s}  {c.detail}")
            if c.fix and c.status != OK:
                lines.append(f"  {'':8s} {'':{width}s}  fix: {c.fix}")
        n = self.counts()
        lines.append(f"{n[OK]} ok, {n[WARNING]} warning(s), {n[FAILURE]} failure(s)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- software


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("python", FAILURE, f"{version} at {sys.executable}", "pointforge needs Python 3.10 or newer")
    return Check("python", OK, f"{version} at {sys.executable}")


def check_torch(needs_cuda: bool) -> list[Check]:
    try:
        import torch
    except Exception as err:  # a broken install
        return [
            Check("torch", FAILURE, f"cannot import torch ({err})", "install torch: make test, or pip install torch")
        ]
    checks = []
    cuda_build = torch.version.cuda
    if cuda_build is None:
        status = FAILURE if needs_cuda else OK
        checks.append(
            Check(
                "torch",
                status,
                f"{torch.__version__} (CPU-only build: no CUDA)",
                'install a CUDA build of torch, e.g. make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"',
            )
        )
        return checks
    checks.append(Check("torch", OK, f"{torch.__version__} (built for CUDA {cuda_build})"))
    try:
        available = torch.cuda.is_available()
    except Exception as err:
        available, why = False, str(err)
    else:
        why = "torch.cuda.is_available() is False"
    if available:
        checks.append(
            Check(
                "CUDA",
                OK,
                f"runtime {cuda_build}, driver OK, {torch.cuda.device_count()} device(s) visible to this process",
            )
        )
    else:
        checks.append(
            Check(
                "CUDA",
                FAILURE if needs_cuda else WARNING,
                f"CUDA not usable: {why}",
                "check the NVIDIA driver (nvidia-smi) and that the driver supports CUDA " + str(cuda_build),
            )
        )
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    checks.append(
        Check(
            "cuDNN",
            OK if cudnn else WARNING,
            str(cudnn) if cudnn else "not available",
            "install a torch build that bundles cuDNN (the standard CUDA wheels do)",
        )
    )
    try:
        nccl = torch.cuda.nccl.version()
        nccl_text = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        checks.append(Check("NCCL", OK, nccl_text))
    except Exception as err:
        checks.append(
            Check(
                "NCCL",
                FAILURE if needs_cuda else WARNING,
                f"not available ({err})",
                "multi-GPU training needs NCCL: use the standard Linux CUDA wheels of torch",
            )
        )
    return checks


# --------------------------------------------------------------------------- GPUs


def check_gpus(
    inventory: GpuInventory, *, physical_needed: list[int] | None, visible_needed: int | None
) -> list[Check]:
    """GPUs on the machine versus what a plan (physical numbers) or a job in this shell (visible count) needs."""
    checks = []
    detail = inventory.describe()
    if inventory.has_details:
        names = sorted({g.name for g in inventory.gpus})
        detail += ": " + ", ".join(names)
    if physical_needed:
        missing = [g for g in physical_needed if g >= inventory.count]
        if missing:
            checks.append(
                Check(
                    "GPUs",
                    FAILURE,
                    f"{detail}; the plan uses GPU {format_gpu_list(physical_needed)}",
                    f"GPU {format_gpu_list(missing)} does not exist: number GPUs 0-{max(inventory.count - 1, 0)} as nvidia-smi does",
                )
            )
        else:
            checks.append(Check("GPUs", OK, f"{detail}; the plan uses GPU {format_gpu_list(physical_needed)}"))
    elif visible_needed:
        visible = _visible_count(inventory)
        if visible < visible_needed:
            checks.append(
                Check(
                    "GPUs",
                    FAILURE,
                    f"{detail}; {visible} visible to this shell, the run needs {visible_needed}",
                    f"use --nproc {visible} or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
                    if visible
                    else "run on a machine with GPUs, or use run.device=cpu",
                )
            )
        else:
            checks.append(
                Check("GPUs", OK, f"{detail}; {visible} visible to this shell, the run needs {visible_needed}")
            )
    else:
        checks.append(Check("GPUs", OK, detail + ("" if inventory.count else "; training runs on the CPU")))
    return checks


def _visible_count(inventory: GpuInventory) -> int:
    if inventory.fake:
        return inventory.count
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return inventory.count
    tokens = [t.strip() for t in mask.split(",") if t.strip()]
    count = 0
    for token in tokens:  # CUDA stops at the first invalid entry
        if token.isdigit() and int(token) >= inventory.count:
            break
        count += 1
    return count


def check_visible_devices(inventory: GpuInventory, *, for_plan: bool, gpus_needed: bool) -> Check:
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    name = "CUDA_VISIBLE_DEVICES"
    if mask is None:
        return Check(name, OK, "unset: every GPU is visible")
    if for_plan:
        return Check(name, OK, f"{mask!r} in this shell; pointforge launch replaces it with each job's own GPUs")
    tokens = [t.strip() for t in mask.split(",")]
    if mask.strip() == "":
        status = FAILURE if gpus_needed else WARNING
        return Check(
            name,
            status,
            "set but empty: every GPU is hidden from this shell",
            "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use",
        )
    problems = []
    seen = set()
    for token in tokens:
        if token.isdigit():
            n = int(token)
            if inventory.count and n >= inventory.count:
                problems.append(
                    f"GPU {n} does not exist (this machine has 0-{inventory.count - 1}): CUDA reports 'invalid device ordinal'"
                )
            if n in seen:
                problems.append(f"GPU {n} is listed twice")
            seen.add(n)
        elif not token.upper().startswith(("GPU-", "MIG-")):
            problems.append(f"{token!r} is neither a GPU number nor a GPU-/MIG- UUID")
    if problems:
        return Check(
            name,
            FAILURE,
            f"{mask!r}: " + "; ".join(problems),
            "unset it (an inherited value from another job is the usual cause) or list existing GPUs, e.g. CUDA_VISIBLE_DEVICES=0,1",
        )
    if len(seen) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and not inventory.fake:
        return Check(
            name,
            WARNING,
            f"{mask!r} without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA may number GPUs differently from nvidia-smi",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID (pointforge launch sets it for its jobs)",
        )
    return Check(name, OK, f"{mask!r}: {len(tokens)} GPU(s) visible, as cuda:0 … cuda:{len(tokens) - 1}")


# --------------------------------------------------------------------------- data


def dataset_root_from_config(task_cfg: Any) -> str | None:
    """The dataset folder a task config names (a field such as ``data_root``), if any."""
    if task_cfg is None or not dataclasses.is_dataclass(task_cfg):
        return None
    for fld in dataclasses.fields(task_cfg):
        value = getattr(task_cfg, fld.name)
        if (
            isinstance(value, str)
            and value
            and ("root" in fld.name or fld.name in ("data", "data_dir", "dataset", "prepared"))
        ):
            return value
    return None


def check_dataset(root: str | os.PathLike) -> Check:
    """The layout (prepared, or raw SkullBreak/SkullFix) and a sample of files readable."""
    import numpy as np

    from pointforge.data.skulls import PreparedDataset, list_cases

    root = Path(root)
    name = "dataset"
    if not root.exists():
        return Check(
            name,
            FAILURE,
            f"{root} does not exist",
            "give the dataset folder with --data (or the config's data root); make one with pointforge data synth / data prepare",
        )
    if not root.is_dir():
        return Check(name, FAILURE, f"{root} is a file, not a dataset folder", "give the folder that holds the dataset")
    try:
        if (root / "cases.csv").exists() or (root / "dataset.json").exists():
            prepared = PreparedDataset(root)
            splits = {s: len(prepared.split(s, require=())) for s in ("train", "val", "test")}
            if not prepared.cases:
                return Check(name, FAILURE, f"{root}: prepared dataset with no cases", "re-run pointforge data prepare")
            sample = _spread(prepared.cases, SAMPLE_FILES)
            for case in sample:
                for rel in (case.defective, case.implant):
                    if rel:
                        points = prepared.points(rel)
                        if points.ndim != 2 or points.shape[1] != 3:
                            return Check(
                                name,
                                FAILURE,
                                f"{prepared.path(rel)} holds an array of shape {points.shape}, not N×3 points",
                                "delete it and re-run pointforge data prepare",
                            )
                        np.asarray(points[:16])  # touch the data, not only the header
            counts = ", ".join(f"{k} {v}" for k, v in splits.items())
            return Check(
                name,
                OK,
                f"{root}: prepared dataset, {len(prepared.cases)} cases ({counts}); {len(sample)} sampled cases readable",
            )
        layout, cases = list_cases(root)
        from pointforge.data.volumes import read_volume

        sample = _spread(cases, SAMPLE_FILES)
        for case in sample:
            read_volume(case.defective)
        return Check(
            name,
            WARNING,
            f"{root}: raw {layout} dataset, {len(cases)} cases; {len(sample)} sampled volumes readable; not prepared yet",
            f"training reads prepared point clouds: pointforge data prepare {root} --out PREPARED, then point the config at PREPARED",
        )
    except UserError as err:
        return Check(name, FAILURE, str(err), "fix the file named, or re-run pointforge data prepare")
    except (OSError, ValueError) as err:
        return Check(
            name,
            FAILURE,
            f"{root}: unreadable ({type(err).__name__}: {err})",
            "check the files' permissions and that they are complete",
        )


def _spread(items: Sequence[Any], n: int) -> list[Any]:
    if len(items) <= n:
        return list(items)
    step = (len(items) - 1) / (n - 1)
    return [items[round(i * step)] for i in range(n)]


# --------------------------------------------------------------------------- disk and shared memory


def _shm_space(path: str | os.PathLike = "/dev/shm") -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory filesystem DataLoader workers use; None where there is none."""
    if not Path(path).is_dir():
        return None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.total, usage.free


def estimate_checkpoint_bytes(task: Any, cfg: Any) -> int | None:
    """Size of one checkpoint (the engine's own estimate, which it checks before training), on a meta-device model."""
    import torch

    from pointforge.train.checkpoint import estimate_checkpoint_bytes as estimate

    try:
        task.configure(cfg.task)
        try:
            with torch.device("meta"):
                model = task.build_model(cfg.task)
        except Exception:
            model = task.build_model(cfg.task)
        return estimate(model, optimizer=cfg.optim.name, ema=bool(cfg.train.ema_decay))
    except Exception:
        return None


def check_disk(
    run_dir: str | os.PathLike,
    checkpoint_bytes: int | None,
    keep_last: int,
    *,
    space: tuple[int, int] | None = None,
    every_epochs: int = 1,
    epochs: int | None = None,
) -> Check:
    """The run dir's disk against its checkpoints: :func:`pointforge.train.preflight.check_disk`, reported."""
    from pointforge.train.preflight import check_disk as preflight_disk

    finding = preflight_disk(
        run_dir,
        checkpoint_bytes,
        keep_last=keep_last,
        every_epochs=every_epochs,
        epochs=epochs,
        free=space[1] if space is not None else None,
    )
    return _from_finding(finding)


def batch_bytes_from_task(task: Any, cfg: Any, micro_batch: int) -> int | None:
    """Bytes of one micro-batch, measured on one training sample (None when the data cannot be read)."""
    try:
        train_ds, _ = task.build_datasets(cfg.task)
        sample = train_ds[0]
    except Exception:
        return None
    return _nbytes(sample) * micro_batch


def _nbytes(obj: Any) -> int:
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def check_shm(
    num_workers: int, nproc: int, prefetch_factor: int, batch_bytes: int | None, *, shm: tuple[int, int] | None
) -> Check:
    """/dev/shm against what DataLoader workers keep there: batches in flight, per worker, per process."""
    name = "/dev/shm"
    if num_workers == 0:
        return Check(name, OK, "not used (data.num_workers=0: batches are loaded in the training process)")
    if shm is None:
        return Check(name, OK, "no /dev/shm on this system (not Linux); DataLoader workers share memory another way")
    total, free = shm
    per_batch = batch_bytes if batch_bytes is not None else FALLBACK_BATCH_BYTES
    # Twice the batches in flight: the copy being handed over and the next one being filled.
    need = 2 * nproc * num_workers * prefetch_factor * per_batch
    how = f"{nproc} process(es) × {num_workers} worker(s) × {prefetch_factor} batches × {format_bytes(per_batch)}" + (
        "" if batch_bytes is not None else " (assumed)"
    )
    detail = f"{format_bytes(total)} ({format_bytes(free)} free); DataLoader workers need about {format_bytes(need)} ({how}, ×2)"
    if free < need:
        return Check(
            name,
            FAILURE,
            detail,
            "lower data.num_workers (0 works anywhere), or enlarge /dev/shm (docker run --shm-size=16g, or mount -o remount,size=16G /dev/shm)",
        )
    return Check(name, OK, detail)


# --------------------------------------------------------------------------- ports, tmux, run dir


def check_port(port: int, *, asked: bool) -> Check:
    name = f"port {port}"
    if port_free(port):
        return Check(name, OK, "free for a rendezvous" + ("" if asked else " (torchrun's default)"))
    owner = port_owner(port)
    by = f" by pid {owner}" if owner else ""
    fix = "choose another port (--rdzv-endpoint HOST:PORT / --master-port), or stop what holds it" + (
        "; pointforge launch picks a free port per job by itself" if not asked else ""
    )
    return Check(name, FAILURE if asked else WARNING, f"in use{by}", fix)


def check_tmux(asked: bool) -> Check | None:
    exe = shutil.which("tmux")
    if exe is None:
        if not asked:
            return None
        return Check(
            "tmux",
            FAILURE,
            "not installed",
            "install tmux (apt-get install tmux), or run pointforge launch without --tmux (jobs run detached)",
        )
    try:
        version = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = exe
    return Check("tmux", OK, version or exe)


def check_run_dir(run_dir: str | os.PathLike, *, resume: str | None) -> list[Check]:
    from pointforge.ops.runs import is_live, run_state
    from pointforge.train.preflight import check_existing_checkpoints, check_run_dir_lock

    run_dir = Path(run_dir)
    checks = []
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".pointforge-doctor-"):
            pass
        where = "exists" if probe == run_dir else f"will be created under {probe}"
        checks.append(Check("run dir", OK, f"{run_dir} is writable ({where})"))
    except OSError as err:
        checks.append(
            Check(
                "run dir",
                FAILURE,
                f"cannot write in {probe} ({err.strerror or err})",
                "choose a run.dir you can write to, or fix the folder's permissions",
            )
        )
        return checks
    lock = check_run_dir_lock(run_dir)
    state = run_state(run_dir, with_disk=False)
    if not lock.ok:
        checks.append(_from_finding(lock))
    elif is_live(state):
        checks.append(
            Check(
                "run dir",
                FAILURE,
                f"{run_dir} is in use by a live job ({state.status}, pid {state.job_pid or state.pid})",
                f"stop it first (pointforge launch --stop {state.name}) or choose another run.dir",
            )
        )
    fresh = check_existing_checkpoints(run_dir, resume)
    if not fresh.ok:
        checks.append(_from_finding(fresh))
    return checks


# --------------------------------------------------------------------------- resume checkpoint


def check_resume(
    resume: str, *, run_dir: str | os.PathLike | None, task: Any = None, cfg: Any = None, nproc: int | None = None
) -> list[Check]:
    """The checkpoint a run would resume from: readable, ours, same task, weights that fit the config's model,
    something left to train."""
    from pointforge.train.preflight import check_resume_point

    name = "resume"
    path, early = _resume_path(resume, run_dir)
    if path is None:
        return early
    checks, info = _checkpoint_checks(path)
    if info is None or cfg is None or task is None:
        return checks
    if info["task"] != task.name:
        checks.append(
            Check(
                name,
                FAILURE,
                f"{path} was written by task {info['task']}, the config is for {task.name}",
                "resume with the matching task and config",
            )
        )
        return checks
    fit = _weights_fit(path, task, cfg)
    checks.append(fit)
    if fit.status != OK:
        return checks
    point = check_resume_point(
        path,
        epoch=int(info.get("epoch") or 0),
        global_step=int(info.get("global_step") or 0),
        epochs=cfg.train.epochs,
        max_steps=cfg.train.max_steps,
    )
    if point.status != OK:
        checks.append(_from_finding(point))
    if nproc and info.get("world_size") and info["world_size"] != nproc:
        checks.append(
            Check(
                name,
                WARNING,
                f"written by {info['world_size']} process(es), resuming on {nproc}: weights, optimizer and schedule "
                "continue exactly, random streams are re-seeded",
                f"for a bit-exact continuation resume on {info['world_size']} process(es)",
            )
        )
    return checks


def _resume_path(resume: str, run_dir: str | os.PathLike | None) -> tuple[Path | None, list[Check]]:
    """The checkpoint ``--resume`` names (None with the checks that end the matter)."""
    from pointforge.train import checkpoint as ckpt_io

    name = "resume"
    if resume != "auto":
        return Path(resume), []
    if run_dir is None:
        return None, [
            Check(
                name,
                WARNING,
                "--resume auto without a config or run dir: nothing to look in",
                "give --config (its run.dir) or a checkpoint path",
            )
        ]
    candidates = ckpt_io.resume_candidates(run_dir)
    if not candidates:
        return None, [Check(name, OK, f"--resume auto: {run_dir} holds no checkpoint yet; the run starts from scratch")]
    return candidates[0], []


def _checkpoint_checks(path: Path) -> tuple[list[Check], dict | None]:
    """Whether ``path`` is a complete, resumable pointforge checkpoint; its inspection when it is."""
    from pointforge.ops.checkpoints import inspect_checkpoint

    name = "resume"
    try:
        info = inspect_checkpoint(path)
    except UserError as err:
        return [Check(name, FAILURE, str(err), "check the path, or use --resume auto")], None
    if not info["complete"]:
        return [
            Check(
                name,
                FAILURE,
                info["problem"],
                "resume from an earlier checkpoint (pointforge ckpt inspect RUN_DIR lists them); --resume auto skips damaged ones",
            )
        ], None
    if info["resumable"] != "yes":
        return [
            Check(
                name,
                FAILURE,
                f"{path}: {info['resumable']}",
                "a run resumes only from a pointforge training checkpoint; to start from these weights, load them into a new run",
            )
        ], None
    return [
        Check(
            name,
            OK,
            f"{path}: task {info['task']}, epoch {info['epoch']}, step {info['global_step']}, "
            f"written by {info['world_size']} process(es), saved on {', '.join(info['saved_devices'])}",
        )
    ], info


def _weights_fit(path: Path, task: Any, cfg: Any) -> Check:
    """Whether the checkpoint's weights fit the model the config builds (built on the meta device: no memory)."""
    import torch

    from pointforge.train import checkpoint as ckpt_io

    name = "resume"
    ckpt = ckpt_io.load_checkpoint(path)
    weights = ckpt_io.strip_prefixes(ckpt_io.model_weights(ckpt))
    try:
        task.configure(cfg.task)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in task.build_model(cfg.task).state_dict().items()}
    except Exception as err:
        return Check(
            name,
            WARNING,
            f"could not build the config's model to compare ({type(err).__name__}: {err})",
            "check the task config",
        )
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    shapes = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if not (missing or unexpected or shapes):
        return Check(name, OK, f"weights fit the config's model ({len(expected)} tensors)")
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} of another shape (e.g. {k}: {tuple(weights[k].shape)} vs {expected[k]})")
    return Check(
        name,
        FAILURE,
        "the checkpoint's weights do not fit the config's model: " + "; ".join(parts),
        "use the config the checkpoint was trained with (pointforge ckpt inspect shows it)",
    )


# --------------------------------------------------------------------------- the whole run


def _guard(name: str, fn: Callable[[], Any]) -> list[Check]:
    """Run one check; an unexpected error becomes a failure of that check, not of the doctor."""
    try:
        result = fn()
    except UserError as err:
        return [Check(name, FAILURE, str(err), "fix what the message names")]
    except Exception as err:
        return [Check(name, FAILURE, f"check crashed: {type(err).__name__}: {err}", "report this as a pointforge bug")]
    if result is None:
        return []
    return result if isinstance(result, list) else [result]


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
        checks += named(_guard("dataset", lambda: check_dataset(root)))
    ck_bytes = None
    if resume and resume != "auto" and Path(resume).is_file():
        ck_bytes = Path(resume).stat().st_size
    if ck_bytes is None:
        ck_bytes = estimate_checkpoint_bytes(task, cfg)
    checks += named(
        _guard(
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
        from pointforge.train.schedule import plan_batches

        try:
            micro = plan_batches(cfg.data.global_batch, nproc, cfg.data.micro_batch).micro_batch
        except UserError:
            micro = max(1, cfg.data.global_batch // nproc)
        batch = batch_bytes_from_task(task, cfg, micro)
    else:
        batch = None
    shm = shm_space if shm_space is not None else _shm_space()
    checks += named(_guard("/dev/shm", lambda: check_shm(workers, nproc, cfg.data.prefetch_factor, batch, shm=shm)))
    checks += named(_guard("run dir", lambda: check_run_dir(cfg.run.dir, resume=resume)))
    if resume:
        checks += named(
            _guard("resume", lambda: check_resume(resume, run_dir=cfg.run.dir, task=task, cfg=cfg, nproc=nproc))
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
    add(_guard("torch", lambda: check_torch(needs_cuda)))
    add(_guard("GPUs", lambda: check_gpus(inventory, physical_needed=physical_needed, visible_needed=visible_needed)))
    add(
        _guard(
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
            add(_guard("dataset", lambda: check_dataset(data)))
        if run_dir is not None:
            add(_guard("run dir", lambda: check_run_dir(run_dir, resume=resume)))
        if resume is not None:
            add(_guard("resume", lambda: check_resume(resume, run_dir=run_dir)))

    if port is not None:
        add([check_port(port, asked=True)])
    elif launch_plan is None:
        add([check_port(DEFAULT_PORT, asked=False)])
    tmux_check = check_tmux(tmux)
    if tmux_check is not None:
        add([tmux_check])
    return report


# The config, task and launch modules import torch; they are imported when a
# check needs them, so that doctor still runs, and says so, when torch is broken.


def _load_launch_plan(plan: str | os.PathLike | None) -> tuple[Any, Check | None]:
    """The launch plan, resolved and checked (None and a failed check when it does not load)."""
    if plan is None:
        return None, None
    from pointforge.ops.launch.plan import build_plan
    from pointforge.ops.launch.spec import load_plan

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
    from pointforge.tasks import get_task
    from pointforge.tasks.configs import load_train_config

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
    from pointforge.tasks import get_task
    from pointforge.tasks.configs import load_train_config

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
    from pointforge.config import load_yaml
    from pointforge.tasks import available_tasks

    data = load_yaml(config)
    named = (data.get("run") or {}).get("task") if isinstance(data.get("run"), dict) else None
    if named:
        return str(named)
    folder = Path(config).resolve().parent.name
    return folder if folder in available_tasks() else None

"""Doctor's checks of a run: its dataset, disk, shared memory, run dir and resume checkpoint.

The checks that can refuse a run (disk, run-dir lock, earlier checkpoints,
resume point) are :mod:`pointforge.train.preflight`'s, reported here as the
engine would refuse them; the rest (a dataset folder's layout, /dev/shm for
loader workers, a checkpoint's fit to the config's model) are the doctor's own.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pointforge.data.skulls.layouts import list_cases
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import read_volume
from pointforge.errors import UserError
from pointforge.formats import format_bytes
from pointforge.ops.checkpoint_surgery import inspect_checkpoint
from pointforge.ops.doctor_report import Check, from_finding
from pointforge.ops.runs import is_live, run_state
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.preflight import (
    FAILURE,
    OK,
    WARNING,
    check_disk as preflight_disk,
    check_existing_checkpoints,
    check_resume_point,
    check_run_dir_lock,
)

# When a sample batch cannot be measured: what one batch in flight is assumed to take.
FALLBACK_BATCH_BYTES = 64 * 2**20
SAMPLE_FILES = 4


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


def dev_shm_space(path: str | os.PathLike = "/dev/shm") -> tuple[int, int] | None:
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
    try:
        task.configure(cfg.task)
        try:
            with torch.device("meta"):
                model = task.build_model(cfg.task)
        except Exception:
            model = task.build_model(cfg.task)
        return ckpt_io.estimate_checkpoint_bytes(model, optimizer=cfg.optim.name, ema=bool(cfg.train.ema_decay))
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
    finding = preflight_disk(
        run_dir,
        checkpoint_bytes,
        keep_last=keep_last,
        every_epochs=every_epochs,
        epochs=epochs,
        free=space[1] if space is not None else None,
    )
    return from_finding(finding)


def batch_bytes_from_task(task: Any, cfg: Any, micro_batch: int) -> int | None:
    """Bytes of one micro-batch, measured on one training sample (None when the data cannot be read)."""
    try:
        train_ds, _ = task.build_datasets(cfg.task)
        sample = train_ds[0]
    except Exception:
        return None
    return _nbytes(sample) * micro_batch


def _nbytes(obj: Any) -> int:
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


def check_run_dir(run_dir: str | os.PathLike, *, resume: str | None) -> list[Check]:
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
        checks.append(from_finding(lock))
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
        checks.append(from_finding(fresh))
    return checks


# --------------------------------------------------------------------------- resume checkpoint


def check_resume(
    resume: str, *, run_dir: str | os.PathLike | None, task: Any = None, cfg: Any = None, nproc: int | None = None
) -> list[Check]:
    """The checkpoint a run would resume from: readable, ours, same task, weights that fit the config's model,
    something left to train."""
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
        checks.append(from_finding(point))
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
    name = "resume"
    ckpt = ckpt_io.load_checkpoint(path)
    weights = ckpt_io.strip_prefixes(ckpt_io.model_weights(ckpt))
    try:
        task.configure(cfg.task)
        with torch.device("meta"):
            model = task.build_model(cfg.task)
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            optional = ckpt_io.optional_state_keys(model)
    except Exception as err:
        return Check(
            name,
            WARNING,
            f"could not build the config's model to compare ({type(err).__name__}: {err})",
            "check the task config",
        )
    missing = [k for k in expected if k not in weights and k not in optional]
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

"""The checkpoint file format: atomic save, device-agnostic load, wrapper prefixes, resume selection.

A pointforge checkpoint is one ``torch.save`` file holding only tensors and
plain containers, so it loads with ``weights_only=True`` (no code runs while
loading). Its top-level keys:

``format``/``format_version``  ``"pointforge.checkpoint"``, 1
``pointforge_version``/``torch_version``/``saved_at``
``task``           task name (``"toy"``, ``"pcdiff"``, ...)
``config``         the resolved :class:`~pointforge.config.training.TrainConfig` as a dict
``model``          state dict of the bare model (no ``module.``/``_orig_mod.``), CPU tensors
``ema``            EMA state dict or ``None``
``optimizer``/``scheduler``/``scaler``   their ``state_dict()`` (scaler may be ``None``)
``progress``       :meth:`TrainState.state_dict() <pointforge.train.state.TrainState.state_dict>`: epoch, step_in_epoch, global_step, samples_seen, best metric, ...
``rng``            ``{"world_size": W, "per_rank": [...]}``: python, numpy, torch, CUDA states per rank
``metrics``        the last logged/evaluated metrics

Every tensor is moved to the CPU before saving, and every load maps to the CPU
(or a device you name) first, so a file written on 8 GPUs loads on a CPU-only
machine, one GPU or any other count — also older files whose storages are
tagged ``cuda:7``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from pointforge import __version__
from pointforge.atomic import atomic_writer
from pointforge.errors import CheckpointError, DiskFullError, disk_full_cause
from pointforge.formats import format_bytes

FORMAT = "pointforge.checkpoint"
FORMAT_VERSION = 1
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
LATEST = "latest.pt"
BEST = "best.pt"
_PERIODIC = re.compile(r"^(epoch|step)-(\d+)\.pt$")


# --------------------------------------------------------------------------- tensors and modules


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return (
            type(obj)((k, to_cpu(v)) for k, v in obj.items())
            if isinstance(obj, dict)
            else {k: to_cpu(v) for k, v in obj.items()}
        )
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP/FSDP-style ``.module`` and ``torch.compile`` wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        compiled_inner = getattr(model, "_orig_mod", None)
        if isinstance(compiled_inner, nn.Module):
            model = compiled_inner
        elif isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ in ("DataParallel",):
            model = cast(nn.Module, model.module)
        else:
            break
    return model


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's state dict on the CPU, ready to save."""
    return to_cpu(unwrap_model(model).state_dict())


def strip_prefixes(state: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES) -> dict[str, Any]:
    """Remove wrapper prefixes that every key carries (repeatedly, e.g. ``module._orig_mod.``)."""
    state = dict(state)
    changed = True
    while changed and state:
        changed = False
        for prefix in prefixes:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
    return state


def optional_state_keys(model: nn.Module) -> set[str]:
    """The state-dict keys ``model``'s modules name in their ``optional_state`` (:func:`load_model_state`)."""
    return {
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        for key in getattr(module, "optional_state", ())
    }


def load_model_state(
    model: nn.Module,
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    extra_prefixes: tuple[str, ...] = (),
) -> None:
    """Load ``state`` into ``model`` (wrapped or not), accepting prefixed keys.

    ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) are always stripped;
    ``extra_prefixes`` (e.g. ``("model.",)`` for upstream PCDiff files) too.
    Tensors are copied onto the model's own device whatever device they name.
    Entries that a module names in its ``optional_state`` (added after older
    checkpoints were written) may be absent: they keep the model's own values.
    """
    target = unwrap_model(model)
    cleaned = strip_prefixes(state, WRAPPER_PREFIXES + tuple(extra_prefixes))
    own = target.state_dict()
    expected = own.keys()
    for key in optional_state_keys(target):
        if key in own and key not in cleaned:
            cleaned[key] = own[key]
    missing = [k for k in expected if k not in cleaned]
    unexpected = [k for k in cleaned if k not in expected]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(
            "checkpoint weights do not fit this model: "
            + "; ".join(parts)
            + "; check that the task and its model config match the checkpoint (pointforge ckpt inspect shows both)"
        )
    try:
        target.load_state_dict(cleaned, strict=strict)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        detail = next((line.strip() for line in first if "size mismatch" in line), first[-1] if first else str(err))
        raise CheckpointError(
            f"checkpoint weights do not fit this model: {detail}; check that the model config matches the checkpoint"
        ) from None


# --------------------------------------------------------------------------- RNG state as plain data


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (weights_only-safe)."""
    version, mt_state, gauss = random.getstate()
    np_state: tuple[str, np.ndarray, int, int, float] = np.random.get_state(legacy=True)  # type: ignore[assignment]  # the legacy tuple
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    state: dict[str, Any] = {
        "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in mt_state.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


# --------------------------------------------------------------------------- save / load


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` atomically (temporary file, fsync, rename); tensors go to the CPU first."""
    path = Path(path)
    payload = to_cpu(dict(state))
    payload.setdefault("format", FORMAT)
    payload.setdefault("format_version", FORMAT_VERSION)
    payload.setdefault("pointforge_version", __version__)
    payload.setdefault("torch_version", str(torch.__version__))  # TorchVersion is not weights_only-safe
    payload.setdefault("saved_at", time.time())
    with atomic_writer(path, "wb") as handle:
        torch.save(payload, handle)
    return path


def save_weights(path: str | os.PathLike, weights: Mapping[str, torch.Tensor]) -> Path:
    """Write a bare state dict (CPU tensors) atomically, e.g. for inference or export."""
    path = Path(path)
    with atomic_writer(path, "wb") as handle:
        torch.save(to_cpu(dict(weights)), handle)
    return path


def load_checkpoint(
    path: str | os.PathLike, *, map_location: str | torch.device = "cpu", weights_only: bool = True
) -> dict[str, Any]:
    """Read a checkpoint onto ``map_location`` (CPU by default), whatever devices it was saved from.

    Raises CheckpointError for a missing, truncated or corrupt file, or one that
    needs code to unpickle (pass ``weights_only=False`` only for files you trust).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; check the path (pointforge ckpt inspect lists a run's checkpoints)"
        )
    with open(path, "rb") as fh:
        head = fh.read(2)
    if not head:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); use an earlier checkpoint")
    # torch.save writes a zip archive ("PK"); very old files are a bare pickle (0x80).
    if head != b"PK" and head[:1] != b"\x80":
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint (neither a torch.save archive nor a pickle); check the path"
        )
    try:
        obj = torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only and "weights_only" in str(err):
            raise CheckpointError(
                f"checkpoint {path} holds Python objects that weights-only loading refuses; "
                "if you trust the file, re-save it with pointforge ckpt remap"
            ) from None
        raise CheckpointError(f"checkpoint {path} is corrupt ({_short(err)}); use an earlier checkpoint") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError) as err:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({_short(err)}); use an earlier checkpoint"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict of states")
    return obj


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


def is_pointforge_checkpoint(ckpt: Mapping[str, Any]) -> bool:
    return ckpt.get("format") == FORMAT


def model_weights(ckpt: Mapping[str, Any], *, use_ema: bool = False) -> dict[str, Any]:
    """The model state dict inside a pointforge checkpoint or a bare/foreign one.

    Accepts our format, ``{"model_state": ...}``/``{"state_dict": ...}``
    layouts and bare state dicts.
    """
    if is_pointforge_checkpoint(ckpt):
        if use_ema and ckpt.get("ema") is not None:
            return dict(ckpt["ema"])
        return dict(ckpt["model"])
    for key in ("model", "model_state", "state_dict", "model_state_dict"):
        inner = ckpt.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return dict(inner)
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return dict(ckpt)
    raise CheckpointError(
        "no model weights found in this checkpoint (looked for model, model_state, state_dict or a bare state dict)"
    )


# --------------------------------------------------------------------------- run-directory layout


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def periodic_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """``epoch-NNNN.pt``/``step-NNNNNNNN.pt`` files, oldest first by their number."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _PERIODIC.match(path.name)
        if match:
            found.append((int(match.group(2)), match.group(1), path))
    return [p for _, _, p in sorted(found)]


def resume_candidates(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints a run could resume from, newest first: ``latest``, periodic ones, ``best`` last.

    ``latest`` is rewritten at every save and periodic files are copies of
    an earlier ``latest``, so this order is also the order of training progress.
    """
    folder = checkpoint_dir(run_dir)
    ordered = [folder / LATEST] if (folder / LATEST).is_file() else []
    ordered += list(reversed(periodic_checkpoints(run_dir)))
    if (folder / BEST).is_file():
        ordered.append(folder / BEST)
    return ordered


def find_resume_checkpoint(
    run_dir: str | os.PathLike, warn: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``run_dir`` that loads, with its contents; ``None`` if there is none.

    A truncated or corrupt file is reported through ``warn`` and skipped in
    favour of the previous good one.
    """
    for path in resume_candidates(run_dir):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as err:
            if warn is not None:
                warn(f"{err}; trying the previous checkpoint")
            continue
        if not is_pointforge_checkpoint(ckpt):
            if warn is not None:
                warn(f"checkpoint {path} is not a pointforge checkpoint; skipping it")
            continue
        return path, ckpt
    return None


# --------------------------------------------------------------------------- disk space


def estimate_checkpoint_bytes(model: nn.Module, *, optimizer: str = "adam", ema: bool = False) -> int:
    """Size of one checkpoint of ``model``: weights, the optimizer's moments, EMA weights, 1 MiB for the rest.

    Works on a model built on the meta device (shapes only), which is how
    ``pointforge doctor`` sizes a run without building it.
    """
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * 4 for p in model.parameters())
    moments = {"adam": 2, "adamw": 2, "sgd": 1}.get(optimizer, 2)
    return int(weights + moments * params + (weights if ema else 0) + 2**20)


def checkpoint_files_kept(keep_last: int, *, every_epochs: int = 1, epochs: int | None = None) -> int:
    """The most checkpoint files a run holds at once.

    ``latest``, ``best``, the periodic ``epoch-NNNN`` files (``ckpt.keep_last``
    of them, or one per ``every_epochs`` epochs when ``keep_last`` is 0 = keep
    all) and one temporary file while the next one is being written.
    """
    periodic = max(keep_last, 0)
    if every_epochs <= 0:
        periodic = 0
    elif epochs is not None:
        every = epochs // every_epochs
        periodic = every if keep_last <= 0 else min(keep_last, every)
    return 2 + periodic + 1


def disk_free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent); None where unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


class CheckpointFiles:
    """Names and retention of a run's checkpoints: ``latest``, periodic ``epoch-NNNN``, ``best``.

    A write that fills the disk raises :class:`~pointforge.errors.DiskFullError`
    (one line: which file, the free space, what to change) instead of torch's
    traceback; the file being written is never left behind half-written (the
    atomic writer removes its temporary file) and the previous one is untouched.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_last: int):
        self.folder = checkpoint_dir(run_dir)
        self.keep_last = keep_last

    @property
    def latest(self) -> Path:
        return self.folder / LATEST

    @property
    def best(self) -> Path:
        return self.folder / BEST

    def periodic(self, epoch: int) -> Path:
        return self.folder / f"epoch-{epoch:04d}.pt"

    def write_latest(self, state: Mapping[str, Any]) -> Path:
        with self._space_guard(self.latest):
            return save_checkpoint(self.latest, state)

    @contextlib.contextmanager
    def _space_guard(self, target: Path) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            cause = disk_full_cause(err)
            if cause is None:
                raise
            raise DiskFullError(self.disk_full_message(target, cause)) from None

    def disk_full_message(self, target: Path, cause: OSError) -> str:
        free = disk_free_bytes(self.folder)
        what = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left on the device"
        left = "unknown space" if free is None else format_bytes(free)
        kept = "the previous checkpoints are intact" if self.latest.is_file() else "no checkpoint was written yet"
        return (
            f"{what} while writing checkpoint {target} ({left} free in {self.folder}); nothing partial was kept and "
            f"{kept}; free space or lower ckpt.keep_last (now {self.keep_last}) and continue "
            "with --resume auto, or choose another run.dir and pass --resume with the last checkpoint"
        )

    def copy_to(self, source: Path, target: Path) -> Path:
        """Make ``target`` an atomic byte copy of ``source``.

        A copy rather than a hard link: damage to one file (a truncation on a
        flaky disk) must not take its twin, the fallback, down with it.
        """
        with self._space_guard(target), open(source, "rb") as src, atomic_writer(target, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        return target

    def prune(self) -> list[Path]:
        """Delete periodic checkpoints beyond the newest ``keep_last``."""
        if self.keep_last <= 0:
            return []
        old = periodic_checkpoints(self.folder.parent)[: -self.keep_last]
        for path in old:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        return old


def summarize(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """What ``pointforge ckpt inspect`` prints: format, task, progress, sizes, devices named."""
    weights = model_weights(ckpt)
    n_params = sum(int(t.numel()) for t in weights.values() if isinstance(t, torch.Tensor))
    prefixes = [p for p in WRAPPER_PREFIXES if weights and all(k.startswith(p) for k in weights)]
    summary: dict[str, Any] = {
        "format": ckpt.get("format", "foreign"),
        "pointforge_version": ckpt.get("pointforge_version"),
        "torch_version": ckpt.get("torch_version"),
        "task": ckpt.get("task"),
        "tensors": len(weights),
        "parameters": n_params,
        "wrapper_prefixes": prefixes,
    }
    if is_pointforge_checkpoint(ckpt):
        summary["progress"] = dict(ckpt.get("progress", {}))
        summary["has_ema"] = ckpt.get("ema") is not None
        summary["has_scaler"] = ckpt.get("scaler") is not None
        summary["rng_world_size"] = (ckpt.get("rng") or {}).get("world_size")
        summary["metrics"] = dict(ckpt.get("metrics") or {})
    return summary

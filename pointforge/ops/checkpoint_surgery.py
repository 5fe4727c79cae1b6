"""Checkpoint surgery: what ``pointforge ckpt inspect`` and ``ckpt remap`` do, as functions.

Both read through the engine's one loader (:func:`pointforge.train.checkpoint.format.load_checkpoint`,
which maps every tensor to the CPU); ``inspect`` also records the device each
storage was *saved* on (``cuda:7`` in a file written by rank 7 of an old run),
which is what makes a checkpoint refuse to load elsewhere with plain ``torch.load``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from pointforge.errors import CheckpointError
from pointforge.train.checkpoint import format as ckpt_io
from pointforge.train.state import TrainState

# What a pointforge checkpoint needs to resume a run.
RESUME_KEYS = ("task", "config", "model", "optimizer", "scheduler", "progress", "rng")


def _load_recording_devices(path: Path, *, trust: bool = False) -> tuple[dict[str, Any], Counter]:
    saved_on: Counter = Counter()

    def to_cpu(storage: Any, location: str) -> Any:
        saved_on[str(location)] += 1
        return storage  # deserialised on the CPU; keep it there

    ckpt = ckpt_io.load_checkpoint(path, map_location=to_cpu, weights_only=not trust)  # type: ignore[arg-type]
    return ckpt, saved_on


def _walk_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _walk_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk_tensors(value)


def key_prefixes(weights: Mapping[str, Any], depth: int = 1) -> dict[str, int]:
    """Tensor counts by the first ``depth`` components of their keys (``{"encoder": 12, "head": 4}``)."""
    counts: Counter = Counter()
    for key in weights:
        parts = str(key).split(".")
        counts[".".join(parts[:depth]) if len(parts) > depth else "(top level)"] += 1
    return dict(sorted(counts.items()))


def config_summary(config: Mapping[str, Any] | None) -> str | None:
    if not config:
        return None
    get = lambda section, key: (config.get(section) or {}).get(key)  # noqa: E731
    parts = [
        f"task {get('run', 'task')}",
        f"{get('train', 'epochs')} epoch(s)"
        + (f", max {get('train', 'max_steps')} steps" if get("train", "max_steps") else ""),
        f"global batch {get('data', 'global_batch')}"
        + (f" (micro {get('data', 'micro_batch')})" if get("data", "micro_batch") else ""),
        f"{get('optim', 'name')} lr {get('optim', 'lr')}"
        + (f" ({get('optim', 'lr_scaling')} scaling)" if get("optim", "lr_scaling") not in (None, "none") else ""),
        f"{get('sched', 'name')} schedule",
        f"amp {get('perf', 'amp')}",
        f"run dir {get('run', 'dir')}",
    ]
    return "; ".join(parts)


def inspect_checkpoint(path: str | os.PathLike, *, trust: bool = False) -> dict[str, Any]:
    """Everything ``ckpt inspect`` shows. A truncated or corrupt file gives ``complete: False`` and the reason."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; check the path (pointforge ckpt inspect RUN_DIR lists a run's checkpoints)"
        )
    info: dict[str, Any] = {"file": str(path), "size_bytes": path.stat().st_size}
    try:
        ckpt, saved_on = _load_recording_devices(path, trust=trust)
    except CheckpointError as err:
        info.update(complete=False, problem=str(err), resumable="no")
        return info
    ours = ckpt_io.is_pointforge_checkpoint(ckpt)
    summary = ckpt_io.summarize(ckpt)
    weights = ckpt_io.model_weights(ckpt)
    tensors = list(_walk_tensors(ckpt))
    missing = [k for k in RESUME_KEYS if ckpt.get(k) is None] if ours else list(RESUME_KEYS)
    info.update(
        complete=True,
        format=summary.get("format"),
        task=summary.get("task"),
        pointforge_version=summary.get("pointforge_version"),
        torch_version=summary.get("torch_version"),
        resumable=(
            "yes"
            if ours and not missing
            else f"no: missing {', '.join(missing)}"
            if ours
            else "no: not a pointforge training checkpoint (weights only; usable as initial weights)"
        ),
        parameters=summary.get("parameters"),
        model_tensors=summary.get("tensors"),
        tensors_total=len(tensors),
        saved_devices=dict(sorted(saved_on.items())),
        dtypes=dict(sorted(Counter(str(t.dtype).replace("torch.", "") for t in tensors).items())),
        wrapper_prefixes=summary.get("wrapper_prefixes"),
        key_prefixes=key_prefixes(ckpt_io.strip_prefixes(weights)),
    )
    if ours:
        # Read as a resume would read it: one layout, owned by TrainState.
        raw = dict(ckpt.get("progress") or {})
        progress = TrainState.from_progress(raw)
        best = progress.best.summary()
        info.update(
            epoch=progress.epoch,
            global_step=progress.global_step,
            step_in_epoch=progress.step_in_epoch,
            world_size=(ckpt.get("rng") or {}).get("world_size") or raw.get("world_size"),
            config=config_summary(ckpt.get("config")),
            has_ema=summary.get("has_ema"),
            has_scaler=summary.get("has_scaler"),
            best={f"best_{k}": v for k, v in best.items()} if best else None,
            metrics=summary.get("metrics"),
            saved_at=_when(ckpt.get("saved_at")),
        )
    else:
        for key in ("epoch", "step", "global_step", "iteration"):
            if isinstance(ckpt.get(key), (int, float)):
                info[key] = ckpt[key]
    return info


def _when(stamp: Any) -> str | None:
    if not isinstance(stamp, (int, float)):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def default_remap_path(source: Path) -> Path:
    return source.with_name(f"{source.stem}.remapped{source.suffix or '.pt'}")


@dataclass
class RemapResult:
    source: Path
    target: Path
    kind: str  # "checkpoint" (everything kept, resumable) or "weights" (a bare state dict)
    tensors: int
    saved_devices: dict[str, int]


def remap_checkpoint(
    source: str | os.PathLike,
    target: str | os.PathLike | None = None,
    *,
    strip_prefix: tuple[str, ...] = (),
    weights_only_output: bool = False,
    use_ema: bool = False,
    trust: bool = False,
    force: bool = False,
) -> RemapResult:
    """Write a device-agnostic copy of ``source``: every tensor on the CPU, wrapper prefixes removed.

    A pointforge checkpoint stays a full checkpoint (optimizer, schedule,
    progress: still resumable) unless ``weights_only_output`` or ``use_ema``
    asks for the bare weights; any other file becomes a bare state dict.
    Written atomically; ``source`` is never modified.
    """
    source = Path(source)
    target = Path(target) if target is not None else default_remap_path(source)
    if target.resolve() == source.resolve():
        raise CheckpointError(
            f"--out {target} is the checkpoint itself; remap never overwrites the original, choose another name"
        )
    if target.exists() and not force:
        raise CheckpointError(f"{target} already exists; choose another --out or add --force to replace it")
    ckpt, saved_on = _load_recording_devices(source, trust=trust)
    prefixes = ckpt_io.WRAPPER_PREFIXES + tuple(strip_prefix)
    if ckpt_io.is_pointforge_checkpoint(ckpt) and not (weights_only_output or use_ema):
        copy = dict(ckpt)
        copy["model"] = ckpt_io.strip_prefixes(ckpt["model"], prefixes)
        if copy.get("ema") is not None:
            copy["ema"] = ckpt_io.strip_prefixes(copy["ema"], prefixes)
        ckpt_io.save_checkpoint(target, copy)
        kind, count = "checkpoint", len(list(_walk_tensors(copy)))
    else:
        cleaned = ckpt_io.strip_prefixes(ckpt_io.model_weights(ckpt, use_ema=use_ema), prefixes)
        ckpt_io.save_weights(target, cleaned)
        kind, count = "weights", len(cleaned)
    # Read it back the way any machine would: weights-only, without mapping devices.
    try:
        torch.load(target, weights_only=True)
    except Exception as err:  # pragma: no cover - would be a bug in saving
        target.unlink(missing_ok=True)
        raise CheckpointError(f"the remapped copy of {source} did not load back ({err}); nothing was written") from None
    return RemapResult(source, target, kind, count, dict(sorted(saved_on.items())))

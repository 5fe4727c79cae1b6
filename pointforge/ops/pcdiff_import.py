"""``pointforge ckpt import-pcdiff``: an upstream PCDiff checkpoint converted into a pointforge one.

An operation on checkpoint files, like ``ckpt remap`` (:mod:`pointforge.ops.checkpoint_surgery`):
it reads upstream's layout (:mod:`pointforge.nn.pvcnn_upstream` maps the
weights) and writes the engine's, so it sits above both the ``pcdiff`` task
and the engine it writes for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pointforge.config.coercion import to_dict
from pointforge.config.training import TrainConfig
from pointforge.errors import CheckpointError, ConfigError
from pointforge.nn.pvcnn_upstream import import_upstream_state_dict
from pointforge.tasks.configs import load_train_config
from pointforge.tasks.pcdiff.config import PRESET_POINTS
from pointforge.tasks.pcdiff.task import PCDiffTask, build_model
from pointforge.train.checkpoint.format import (
    capture_rng,
    is_pointforge_checkpoint,
    load_checkpoint,
    load_model_state,
    restore_rng,
    save_checkpoint,
)
from pointforge.train.data import derive_seed, seed_everything
from pointforge.train.schedule import build_optimizer, build_scheduler
from pointforge.train.state import BestMetric, TrainState

__all__ = ["ImportResult", "import_pcdiff_checkpoint"]


@dataclass
class ImportResult:
    path: Path
    preset: str
    prefix: str  # the key prefix stripped ("model." or "model.module.")
    upstream_epoch: int | None
    epochs_done: int  # what a resumed run counts as finished
    tensors: int
    parameters: int


def _check_upstream_formulation(task) -> None:
    """Upstream networks are ε-predicting PVCNN2s over xyz in the skull's frame; a config asking
    for another formulation would load the weights into a model that reads them differently."""
    d = task.diffusion
    changed = [
        name
        for name, on in (
            ("task.frame", task.frame is not None),
            ("task.condition_mark", task.condition_mark),
            ("task.diffusion.prediction", d.prediction != "eps"),
            ("task.diffusion.zero_terminal_snr", d.zero_terminal_snr),
        )
        if on
    ]
    if changed:
        raise ConfigError(
            f"an upstream PCDiff checkpoint uses the upstream formulation, but the config sets {', '.join(changed)}; "
            "import with pointforge/configs/pcdiff/paper.yaml or a config without them"
        )


def _read_upstream(source: Path, target: Path, preset: str | None, *, overwrite: bool, trust: bool):
    """The upstream weights in ``source``, mapped and identified; one clear error for every way this cannot work."""
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} already exists; choose another output path or pass --force to replace it")
    if target.resolve() == source.resolve():
        raise ConfigError(f"the output {target} is the input checkpoint; write the converted file elsewhere")
    if preset is not None and preset not in PRESET_POINTS:
        raise ConfigError(f"unknown PVCNN2 preset {preset!r}; choose one of {', '.join(PRESET_POINTS)}")
    upstream = load_checkpoint(source, weights_only=not trust)
    if is_pointforge_checkpoint(upstream):
        raise CheckpointError(
            f"{source} is already a pointforge checkpoint (task '{upstream.get('task')}'); load it directly"
        )
    imported = import_upstream_state_dict(upstream, preset)
    if imported.preset is None:
        raise CheckpointError(
            f"{source} holds a PVCNN2 that differs from every preset ({', '.join(PRESET_POINTS)}); "
            "the pcdiff task builds its network from a preset, so this checkpoint cannot be trained or loaded here"
        )
    return imported


def _import_config(
    source: Path, network: str, config: str | os.PathLike | None, overrides: Sequence[str]
) -> TrainConfig:
    """The training config the converted file carries: ``config`` and ``overrides`` (else the defaults), for ``network``'s preset."""
    cfg = load_train_config(PCDiffTask.name, config, list(overrides))
    chosen = cfg.task.model
    named_in_config = config is not None or any(o.split("=", 1)[0].strip() == "task.model" for o in overrides)
    if named_in_config and chosen != network:
        raise ConfigError(
            f"the config's task.model is '{chosen}' but {source} holds a '{network}' network; use a {network} config"
        )
    if chosen != network:
        cfg = load_train_config(PCDiffTask.name, config, [*overrides, f"task.model={network}"])
    return cfg


def import_pcdiff_checkpoint(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    preset: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    overwrite: bool = False,
    trust: bool = False,
) -> ImportResult:
    """Convert an upstream PCDiff checkpoint into a pointforge ``pcdiff`` training checkpoint.

    ``source``: upstream's ``{"epoch", "model_state", "optimizer_state"}`` file
    (keys ``model.`` or, from DDP, ``model.module.``) or a bare state dict. The
    network is identified by :func:`~pointforge.nn.pvcnn_upstream.import_upstream_state_dict`
    (``preset`` forces one). The written file has the engine's layout: the
    resolved training config (``config`` YAML and ``overrides``, else the
    defaults, with ``task.model`` set to the preset), the weights, no EMA,
    and a *fresh* optimizer and LR-schedule state — upstream's Adam moments
    are dropped — plus progress saying ``upstream epoch + 1`` epochs are done
    (the epoch upstream would resume at) with the step counter at 0. So both
    ``load_pcdiff`` and ``pointforge train pcdiff --resume OUT.pt`` accept it.
    Written atomically; an existing ``target`` is kept unless ``overwrite``.
    """
    source, target = Path(source), Path(target)
    imported = _read_upstream(source, target, preset, overwrite=overwrite, trust=trust)
    cfg = _import_config(source, imported.preset, config, overrides)
    _check_upstream_formulation(cfg.task)
    model = build_model(cfg.task)
    load_model_state(model, imported.state_dict)
    optimizer = build_optimizer(PCDiffTask().parameters(model), cfg.optim, cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.sched, max(1, cfg.train.epochs))
    epochs_done = 0 if imported.epoch is None else imported.epoch + 1
    # A single-rank resume gets the RNG streams a fresh run would have on rank 0.
    saved_rng = capture_rng()
    try:
        seed_everything(derive_seed(cfg.train.seed, "rank", 0))
        rng = capture_rng()
    finally:
        restore_rng(saved_rng)
    state = {
        "task": PCDiffTask.name,
        "config": to_dict(cfg),
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "ema": None,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": None,
        "progress": TrainState(
            epoch=epochs_done,
            world_size=1,
            global_batch=cfg.data.global_batch,
            best=BestMetric(PCDiffTask.best_metric, PCDiffTask.best_mode),
        ).state_dict(),
        "rng": {"world_size": 1, "per_rank": [rng]},
        "metrics": {},
        "imported_from": {
            "path": str(source),
            "format": "upstream PCDiff (train_completion.py)",
            "upstream_epoch": imported.epoch,
            "prefix": imported.prefix,
            "optimizer_state": "dropped (fresh Adam state)",
        },
    }
    save_checkpoint(target, state)
    n_params = sum(int(p.numel()) for p in model.parameters())
    return ImportResult(
        target, imported.preset, imported.prefix, imported.epoch, epochs_done, len(imported.state_dict), n_params
    )

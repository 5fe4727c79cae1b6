"""Upstream PCDiff's PVCNN2 state dicts (``train_completion.py`` checkpoints) mapped onto ours.

Upstream saves ``{"epoch", "model_state", "optimizer_state"}`` where ``model_state`` is the
state dict of its ``Model`` wrapper: the PVCNN2 keys prefixed ``model.`` (single process) or
``model.module.`` (saved from DistributedDataParallel). Our :class:`~pointforge.nn.pvcnn.PVCNN2`
uses upstream's key names without that prefix, so importing is: strip the prefix, find
the configuration whose keys and shapes match exactly, and check every tensor.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor

from pointforge.errors import CheckpointError, ConfigError
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvcnn_config import PRESETS, PVCNN2Config, get_preset, resolve_config

__all__ = ["ImportedPCDiff", "expected_shapes", "import_upstream_state_dict"]

# Longest first: a DDP checkpoint's keys also start with "model.".
_PREFIXES = ("model.module.", "model.", "module.", "")
_PVCNN2_ROOTS = ("sa_layers.", "fp_layers.", "global_att.", "classifier.", "embedf.")
_EXAMPLES = 3


class ImportedPCDiff(NamedTuple):
    """Result of :func:`import_upstream_state_dict`."""

    state_dict: dict[str, Tensor]  # our keys, in our model's order
    config: PVCNN2Config
    epoch: int | None
    preset: str | None  # the matching preset's name, None for a config given or inferred otherwise
    prefix: str  # the prefix that was stripped ("model.", "model.module.", ...)


def expected_shapes(config: PVCNN2Config | str | Mapping) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a PVCNN2 state dict for ``config`` (built on the meta device: no memory, fast)."""
    return dict(_expected_shapes(resolve_config(config)))


@functools.lru_cache(maxsize=16)
def _expected_shapes(config: PVCNN2Config) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = PVCNN2(config)
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


def _shown(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:_EXAMPLES])


def _differences(found: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [k for k in expected if k in found and tuple(found[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} key{'s' if len(missing) > 1 else ''} such as {_shown(missing)}")
    if unexpected:
        problems.append(
            f"unexpected {len(unexpected)} key{'s' if len(unexpected) > 1 else ''} such as {_shown(unexpected)}"
        )
    if shapes:
        k = shapes[0]
        more = f" (and {len(shapes) - 1} more shape differences)" if len(shapes) > 1 else ""
        problems.append(f"shape of {k!r} is {tuple(found[k].shape)}, expected {expected[k]}{more}")
    return problems


def _unwrap(checkpoint: Any) -> tuple[Mapping[str, Any], int | None]:
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"not a PCDiff checkpoint: expected a dict, got {type(checkpoint).__name__}")
    if "model_state" in checkpoint:
        state = checkpoint["model_state"]
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"not a PCDiff checkpoint: 'model_state' is a {type(state).__name__}, expected a state dict"
            )
        epoch = checkpoint.get("epoch")
        if isinstance(epoch, Tensor) and epoch.numel() == 1:
            epoch = epoch.item()
        return state, (int(epoch) if isinstance(epoch, (int, float)) else None)
    if checkpoint and all(isinstance(v, Tensor) for v in checkpoint.values()):
        return checkpoint, None
    keys = [str(k) for k in list(checkpoint)[:5]]
    raise CheckpointError(
        f"not a PCDiff checkpoint: no 'model_state' entry and not a state dict (top-level keys: {', '.join(keys) or 'none'}); "
        "pass upstream's {'epoch', 'model_state', 'optimizer_state'} checkpoint or its model_state"
    )


def _strip_prefix(state: Mapping[str, Any]) -> tuple[dict[str, Tensor], str]:
    keys = [str(k) for k in state]
    for prefix in _PREFIXES:
        if all(k.startswith(prefix) for k in keys):
            break
    stripped = {k[len(prefix) :]: v for k, v in state.items()}
    if not any(k.startswith(_PVCNN2_ROOTS) for k in stripped):
        raise CheckpointError(
            f"not a PCDiff PVCNN2 checkpoint: none of its {len(keys)} weights look like PVCNN2's "
            f"(found {_shown(keys)}; expected names such as 'model.sa_layers.0.0.voxel_layers.0.weight')"
        )
    for k, v in stripped.items():
        if not isinstance(v, Tensor):
            raise CheckpointError(
                f"PCDiff checkpoint entry {prefix + k!r} is a {type(v).__name__}, not a tensor; the file is not a model state dict"
            )
        if not v.is_floating_point():
            raise CheckpointError(
                f"PCDiff checkpoint entry {prefix + k!r} has dtype {v.dtype}; PVCNN2 weights are floating point"
            )
    return stripped, prefix


def _inferred_variants(state: Mapping[str, Tensor]) -> list[tuple[str, PVCNN2Config]]:
    """Each preset, and each preset with the scalars readable from the weights substituted."""
    scalars: dict[str, Any] = {}
    if "embedf.0.weight" in state and state["embedf.0.weight"].dim() == 2:
        scalars["embed_dim"] = int(state["embedf.0.weight"].shape[0])
    if "classifier.2.weight" in state and state["classifier.2.weight"].dim() >= 1:
        scalars["num_classes"] = int(state["classifier.2.weight"].shape[0])
    first = state.get("sa_layers.0.0.voxel_layers.0.weight")
    if first is not None and first.dim() == 5 and first.shape[1] >= 3:
        scalars["extra_feature_channels"] = int(first.shape[1]) - 3
    scalars["global_attention"] = any(k.startswith("global_att.") for k in state)
    variants = []
    for name in PRESETS:
        preset = get_preset(name)
        variants.append((name, preset))
        try:
            variant = replace(preset, **scalars)
        except ConfigError:  # the substituted scalars make an invalid config: not a candidate
            continue
        if variant != preset:
            variants.append(
                (
                    f"{name} (with {', '.join(f'{k}={v}' for k, v in scalars.items() if getattr(preset, k) != v)})",
                    variant,
                )
            )
    return variants


def import_upstream_state_dict(
    checkpoint_or_state_dict: Mapping[str, Any], config: PVCNN2Config | str | Mapping | None = None
) -> ImportedPCDiff:
    """Validate an upstream PCDiff checkpoint (or bare state dict) and convert it to ours.

    ``config``: a preset name, a :class:`PVCNN2Config` or its dict; when None the
    configuration is inferred: the preset whose keys and shapes match exactly, also trying
    each preset with ``embed_dim``, ``num_classes``, ``extra_feature_channels`` and global
    attention as read from the weights. (Voxel resolutions, centre counts, radii and
    neighbour counts leave no trace in the weights: a network that differs there needs
    its config passed.)

    Raises :class:`~pointforge.errors.CheckpointError` with what differs.
    """
    state, epoch = _unwrap(checkpoint_or_state_dict)
    stripped, prefix = _strip_prefix(state)

    if config is not None:
        try:
            resolved = resolve_config(config)
        except ConfigError as exc:
            raise CheckpointError(f"cannot import the PCDiff checkpoint with the given config: {exc}") from None
        name = config if isinstance(config, str) else None
        problems = _differences(stripped, expected_shapes(resolved))
        if problems:
            what = f"preset {name!r}" if name else "the given config"
            raise CheckpointError(f"PCDiff checkpoint does not fit {what}: {'; '.join(problems)}")
        return ImportedPCDiff(_ordered(stripped, resolved), resolved, epoch, name, prefix)

    best: tuple[int, str, list[str]] | None = None
    for label, candidate in _inferred_variants(stripped):
        problems = _differences(stripped, expected_shapes(candidate))
        if not problems:
            preset = label if label in PRESETS else None
            return ImportedPCDiff(_ordered(stripped, candidate), candidate, epoch, preset, prefix)
        score = _mismatch_count(stripped, expected_shapes(candidate))
        if best is None or score < best[0]:
            best = (score, label, problems)
    assert best is not None
    _, label, problems = best
    raise CheckpointError(
        f"PCDiff checkpoint matches no PVCNN2 preset ({', '.join(PRESETS)}); closest is {label}: {'; '.join(problems)}; "
        "pass config= with the network's PVCNN2Config"
    )


def _mismatch_count(found: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]]) -> int:
    keys = set(found) | set(expected)
    return sum(1 for k in keys if k not in found or k not in expected or tuple(found[k].shape) != expected[k])


def _ordered(state: Mapping[str, Tensor], config: PVCNN2Config) -> dict[str, Tensor]:
    return {k: state[k] for k in expected_shapes(config)}

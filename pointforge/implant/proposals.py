"""Implant proposals: the missing bone's points, sampled from a trained PCDiff in the skull's own coordinates.

* :func:`complete` — ``n`` implant proposals for a defective skull given as
  points in any coordinates: the conditioning subsample, the training
  normalisation (or, for a model trained with ``task.frame``, the frame its
  atlas estimates), one batched pass of
  :func:`~pointforge.nn.diffusion.pipeline.sample_ensemble` and the way back;
* :func:`proposal_sampler` — the sampler ``pointforge generate --sampler
  --steps`` runs (:data:`GENERATE_STEPS`: its default step counts);
* :func:`inside_volume` — proposals kept inside the volume they are for.

The model comes from :func:`pointforge.inference.pcdiff.load_pcdiff`.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence, cast

import numpy as np
import torch
from torch import nn

from pointforge.data.skulls.normalization import bbox_normalization
from pointforge.errors import ConfigError, DataError
from pointforge.nn.diffusion.pipeline import sample_ensemble
from pointforge.nn.diffusion.samplers.base import Sampler
from pointforge.nn.diffusion.samplers.registry import make_sampler
from pointforge.nn.diffusion.schedule import NoiseSchedule
from pointforge.nn.pvops.fps import furthest_point_sample_indices
from pointforge.tasks.pcdiff.config import PCDiffConfig
from pointforge.tasks.pcdiff.dataset import HALF_EXTENT
from pointforge.tasks.pcdiff.frame import PriorSection, atlas_estimate, frame_condition, prior_points
from pointforge.tasks.pcdiff.student import StudentConfig, student_sampler

__all__ = ["GENERATE_STEPS", "proposal_sampler", "complete", "inside_volume"]

# DDIM with 7 steps: the fewest model calls within 0.01 DSC of DDPM-1000 on a model that has
# learned (20 held-out cases: docs/pcdiff.md, "Choosing a sampler"); 5 steps lose 0.02.
GENERATE_STEPS = {"ddim": 7}


def proposal_sampler(
    name: str,
    steps: int | None,
    schedule: NoiseSchedule | None,
    prior: PriorSection | None = None,
    student: StudentConfig | None = None,
) -> Sampler:
    """Sampler ``name`` on the model's ``schedule``; ``steps`` None: :data:`GENERATE_STEPS`, else the sampler's default.

    For a model trained with ``task.prior`` (its config's ``prior``) the sampler starts at the prior's step.
    A few-step ``student`` (:func:`~pointforge.inference.pcdiff.load_pcdiff`'s ``.student``) runs
    its own DDIM steps (:func:`~pointforge.tasks.pcdiff.student.student_sampler`): ``ddim``
    with ``steps`` None or its number of calls, a ConfigError for anything else."""
    if student is not None:
        return _student_sampler(name, steps, schedule, prior, student)
    if steps is None:
        steps = GENERATE_STEPS.get(str(name).lower())
    start = prior.start_step if prior is not None else None
    if steps is not None and start is not None:
        steps = min(steps, start + 1)
    return make_sampler(name, steps, schedule=schedule, start=start)


def _student_sampler(
    name: str, steps: int | None, schedule: NoiseSchedule | None, prior: PriorSection | None, student: StudentConfig
) -> Sampler:
    calls = student.calls
    what = f"a {calls}-call student of {student.teacher_sampler}-{student.teacher_steps}"
    if str(name).lower() != "ddim":
        raise ConfigError(
            f"this PCDiff is {what}; it samples with its own DDIM steps: use --sampler ddim (--steps {calls} or none)"
        )
    if steps is not None and steps != calls:
        more = "more" if steps > calls else "fewer"
        raise ConfigError(
            f"--steps {steps} asks {what} for {more} calls than it was distilled for; use --steps {calls} "
            f"or leave it out (its teacher, {student.teacher}, samples with more)"
        )
    assert schedule is not None  # load_pcdiff gives a student its teacher's schedule
    return student_sampler(student, schedule, prior)


def _as_points(skull_points: Any) -> tuple[np.ndarray, bool]:
    is_torch = isinstance(skull_points, torch.Tensor)
    array = skull_points.detach().cpu().numpy() if is_torch else np.asarray(skull_points)
    if array.ndim != 2 or array.shape[1] != 3 or array.shape[0] < 2:
        raise DataError(f"skull points must be an [M, 3] array with M >= 2, got shape {tuple(array.shape)}")
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(f"skull points must be numbers, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise DataError("skull points contain NaN or infinite coordinates")
    return array, is_torch


def _subsample_indices(points: np.ndarray, n: int, how: str, generator: torch.Generator | None) -> np.ndarray:
    m = points.shape[0]
    if m <= n:
        # Fewer points than the network was trained with: all of them, topped up with repeats.
        extra = torch.randint(0, m, (n - m,), generator=generator).numpy() if n > m else np.empty(0, np.int64)
        return np.concatenate([np.arange(m), extra])
    if how == "random":
        return torch.randperm(m, generator=generator)[:n].numpy()
    coords = torch.from_numpy(points.T[None].astype(np.float32))
    return furthest_point_sample_indices(coords, n)[0].numpy()


def _framed_condition(points, model, config, n_skull, spacing, generator):
    atlas = getattr(model, "atlas_mm", None)
    if atlas is None or atlas.numel() == 0:
        raise ConfigError(
            "the config has task.frame but the model carries no atlas; load it with load_pcdiff from its checkpoint"
        )
    spacing = np.broadcast_to(np.asarray(spacing, dtype=np.float64), (3,))
    agree = config.prior.agree if config.prior is not None else 0.5
    estimate = atlas_estimate(atlas, points, spacing, config.frame, agree)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    rng = np.random.default_rng(seed)
    chosen, norm = frame_condition(points, estimate.center, n_skull, config.frame, rng, half_extent=HALF_EXTENT)
    return chosen, norm, estimate.points, rng


def _prior_start(config: PCDiffConfig, sampler: Sampler, estimate, norm, n: int, n_implant: int, rng) -> torch.Tensor:
    """``[n, 3, n_implant]``: each proposal's own draw of the atlas's implant points, in the frame."""
    assert config.prior is not None
    if int(sampler.timesteps[0]) != config.prior.start_step:
        raise ConfigError(
            f"the model samples from its prior at step {config.prior.start_step} but the sampler starts at "
            f"{int(sampler.timesteps[0])}; build it with proposal_sampler(..., prior=config.prior)"
        )
    draws = np.stack([norm.apply(prior_points(estimate, n_implant, rng)) for _ in range(n)])
    return torch.from_numpy(draws).transpose(1, 2).contiguous()


def _point_counts(
    config: PCDiffConfig | None, sampler: Sampler, n: int, n_skull: int | None, n_implant: int | None, subsample: str
) -> tuple[int, int]:
    """``complete``'s arguments checked (ConfigError naming the wrong one); the point counts, ``config``'s by default."""
    if config is not None:
        n_skull = config.n_skull if n_skull is None else n_skull
        n_implant = config.n_implant if n_implant is None else n_implant
        if sampler.schedule.num_timesteps != config.diffusion.timesteps:
            raise ConfigError(
                f"the sampler runs a {sampler.schedule.num_timesteps}-step schedule but the model was trained with "
                f"{config.diffusion.timesteps} steps; build it with make_sampler(..., schedule=<load_pcdiff's schedule>)"
            )
    if n_skull is None or n_implant is None:
        raise ConfigError(
            "complete() needs the model's point counts: pass config= (from load_pcdiff) or n_skull= and n_implant="
        )
    for name, value in (("n", n), ("n_skull", n_skull), ("n_implant", n_implant)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if subsample not in ("random", "fps"):
        raise ConfigError(f"subsample must be 'random' or 'fps', got {subsample!r}")
    return int(n_skull), int(n_implant)


def complete(
    skull_points: Any,
    model: nn.Module,
    sampler: Sampler,
    n: int = 1,
    *,
    config: PCDiffConfig | None = None,
    n_skull: int | None = None,
    n_implant: int | None = None,
    subsample: Literal["random", "fps"] = "random",
    generator: torch.Generator | None = None,
    progress: Callable[[int, int], None] | None = None,
    spacing: float | Sequence[float] = 1.0,
) -> np.ndarray | torch.Tensor:
    """``n`` implant proposals ``[n, n_implant, 3]`` for a defective skull, in the input's coordinates.

    ``skull_points``: ``[M, 3]`` (NumPy or torch) points of the defective skull
    in any coordinates, e.g. voxel indices of its surface. They are
    subsampled to the ``n_skull`` conditioning points the model was trained
    with (``random``, as training draws them, or ``fps``; with fewer than
    ``n_skull`` points all are used and some repeated), normalised exactly as
    the dataset normalises (centre and half-extent 3 of the subsampled
    skull's bounding box), completed ``n`` times in one batched pass of
    ``sampler`` (:func:`~pointforge.nn.diffusion.pipeline.sample_ensemble`)
    and mapped back. ``n_skull``/``n_implant`` default to ``config``'s (the
    ``config`` of :func:`~pointforge.inference.pcdiff.load_pcdiff`'s result).
    ``generator`` (a CPU generator gives the same result on any device)
    draws the subsample and the starting noise;
    ``progress(step, steps)`` is called after each sampler step.

    A model trained with ``task.frame`` (:mod:`pointforge.tasks.pcdiff.frame`)
    is conditioned as it was trained: its atlas estimates the implant centre
    (``spacing``: mm per unit of ``skull_points``' coordinates, 1 for mm), the
    ``n_skull`` points are drawn from the skull points nearest that centre
    (``subsample`` does not apply) and sampling starts around it.

    Returns a NumPy float32 array for NumPy input, a CPU float32 tensor for a tensor.
    """
    n_skull, n_implant = _point_counts(config, sampler, n, n_skull, n_implant, subsample)
    points, as_torch = _as_points(skull_points)
    init = None
    if config is not None and config.frame is not None:
        chosen, norm, estimate, rng = _framed_condition(points, model, config, n_skull, spacing, generator)
        init = None if config.prior is None else _prior_start(config, sampler, estimate, norm, int(n), n_implant, rng)
    else:
        chosen = points[_subsample_indices(points, n_skull, subsample, generator)]
        norm = bbox_normalization(chosen, HALF_EXTENT)
    device = next(model.parameters()).device
    cond = torch.from_numpy(norm.apply(chosen)).to(device).T.contiguous()  # [3, n_skull]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            start = None if init is None else init.to(device)
            out = sample_ensemble(
                model, sampler, cond, n_implant, int(n), generator=generator, init=start, progress=progress
            )
    finally:
        model.train(was_training)
    implants = out[:, :, cond.shape[1] :].transpose(1, 2)  # [n, n_implant, 3] normalised
    mapped = norm.inverse(implants.float())
    return torch.from_numpy(mapped) if as_torch else mapped


def inside_volume(implants: np.ndarray, shape: tuple[int, int, int], notes: list[str]) -> np.ndarray:
    """Keep each proposal's points that lie in the volume (one voxel of slack).

    A trained model's points lie on the skull; points far outside come from an
    undertrained model or an input unlike the training data. A few stray points
    are replaced by copies of inside ones (the proposals stay one array) and
    noted in the report; a proposal with fewer than half its points inside is
    an error rather than an implant.
    """
    hi = np.asarray(shape, dtype=np.float64)
    inside = cast(np.ndarray, ((implants >= -1.0) & (implants <= hi)).all(axis=2))  # [n, P]
    if inside.all():
        return implants
    worst = float(inside.mean(axis=1).min())
    if worst < 0.5:
        raise DataError(
            f"the PCDiff proposals fall outside the volume ({100 * (1 - worst):.0f}% of one proposal's points); "
            "the model is undertrained or this skull is unlike its training data"
        )
    fixed = implants.copy()
    for k in range(len(implants)):
        good = np.flatnonzero(inside[k])
        bad = np.flatnonzero(~inside[k])
        if bad.size:
            fixed[k, bad] = implants[k, good[np.arange(bad.size) % good.size]]
    notes.append(f"{int((~inside).sum())} generated points outside the volume were replaced by copies of inside ones")
    return fixed

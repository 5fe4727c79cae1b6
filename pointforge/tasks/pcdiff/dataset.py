"""PCDiff's data: the prepared dataset (built once from ``task.synthetic`` where asked) and its items.

:func:`ensure_prepared_dataset` finds or builds the prepared dataset;
:class:`PCDiffDataset` serves ``n_skull`` condition points (with ``task.frame``:
those nearest the implant, in its local frame) and ``n_implant`` implant points, normalised.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pointforge.data.cache import SyntheticSection, ensure_synthetic_prepared
from pointforge.data.skulls.datasets import CompletionDataset
from pointforge.data.skulls.normalization import Normalization, bbox_normalization
from pointforge.errors import DataError
from pointforge.tasks.pcdiff.frame import (
    FrameSection,
    ImplantEstimate,
    PriorSection,
    atlas_estimate,
    frame_condition,
    prior_points,
)
from pointforge.train.logs import get_logger

__all__ = ["HALF_EXTENT", "PCDiffDataset", "ensure_prepared_dataset"]

log = get_logger("pcdiff")

HALF_EXTENT = 3.0  # normalised clouds lie within about ±3 (as upstream PCDiff, github.com/pfriedri/pcdiff-implant)


def _say(message: str) -> None:
    """Log ``message``; where nothing has set up logging (e.g. the planning pass that
    ``--nproc`` runs before starting workers), print it to stderr instead of losing it."""
    if log.hasHandlers():
        log.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


HALF_EXTENT = 3.0  # normalised clouds lie within about ±3 (as upstream PCDiff, github.com/pfriedri/pcdiff-implant)


_PREPARED_FILES = ("cases.csv", "dataset.json")


def _is_prepared(root: Path) -> bool:
    return all((root / name).is_file() for name in _PREPARED_FILES)


def ensure_prepared_dataset(
    root: str | os.PathLike,
    synthetic: SyntheticSection | None = None,
    *,
    lock_timeout_s: float | None = None,
) -> Path:
    """The prepared dataset at ``root``; with ``synthetic`` and nothing there yet, one is built first.

    The building (synthesise, prepare, rename into place under a file lock so
    the ranks of one job can all call this) is :func:`pointforge.data.cache.ensure_synthetic_prepared`.
    """
    root = Path(root)
    if synthetic is None:
        if _is_prepared(root):
            return root
        raise DataError(
            f"{root}: no prepared dataset here (cases.csv, dataset.json); run `pointforge data prepare RAW_ROOT --out {root}` "
            "or set task.synthetic to build a synthetic one"
        )
    if root.exists() and not _is_prepared(root):
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()  # an empty folder to build into: the builder renames a finished folder into place
        else:
            raise DataError(
                f"{root}: exists but is not a prepared dataset; point task.data_root at an empty or new folder to synthesise into"
            )
    return ensure_synthetic_prepared(
        root,
        synthetic.skulls,
        synthetic.size,
        synthetic.seed,
        synthetic.points,
        log=_say,
        split=synthetic.split,
        family=synthetic.family,
        timeout_s=3600.0 if lock_timeout_s is None else lock_timeout_s,
    )


class PCDiffDataset(CompletionDataset):
    """:class:`CompletionDataset` items plus ``spacing`` [3] (mm per voxel of the case's points).

    ``max_cases`` keeps the first cases in ``cases.csv`` order. ``mirror``
    (training augmentation) mirrors half the items left-right: array axis 0
    negated in the normalised coordinates, so about the skull's mid-plane, or
    about the frame's centre with ``frame``; drawn by its own seed, so the
    subsampling is the same with and without it.
    """

    def __init__(
        self,
        root,
        split: str,
        *,
        max_cases: int | None = None,
        frame: FrameSection | None = None,
        atlas: torch.Tensor | None = None,
        prior: PriorSection | None = None,
        mirror: bool = False,
        **kwargs: Any,
    ):
        super().__init__(root, split, **kwargs)
        self.mirror = bool(mirror)
        if max_cases is not None:
            self.cases = self.cases[:max_cases]
        self._spacing: dict[str, torch.Tensor] = {}
        # With a frame: no atlas = the true implant centre, jittered (training);
        # an atlas = its estimate, as inference makes it (validation).
        # With an atlas and a prior: the atlas's implant points too ("prior"), to start sampling from.
        self.frame, self.atlas, self.prior = frame, atlas, prior
        self._estimates: dict[str, ImplantEstimate] = {}
        # Per case, what does not change between epochs (the skull's bounding box, the
        # implant's mean): ~40% of an item's time on the demo's data, recomputed before.
        self._boxes: dict[str, Normalization] = {}
        self._implant_means: dict[str, np.ndarray] = {}

    def spacing(self, index: int) -> torch.Tensor:
        case = self.cases[index]
        if case.defective not in self._spacing:
            try:
                spacing = self.data.meta(case.defective)["spacing"]
            except (OSError, ValueError, KeyError) as err:
                raise DataError(
                    f"{self.data.path(case.defective)}: its .json metadata has no readable spacing ({err}); re-run pointforge data prepare"
                ) from None
            self._spacing[case.defective] = torch.tensor([float(s) for s in spacing], dtype=torch.float32)
        return self._spacing[case.defective]

    def __getitem__(self, index: int) -> dict:
        item = super().__getitem__(index) if self.frame is None else self._framed(index)
        item["spacing"] = self.spacing(index)
        if self.mirror and np.random.default_rng([self.seed, self.epoch, index, 1]).uniform() < 0.5:
            points = item["points"].clone()
            points[:, 0] = -points[:, 0]
            item["points"] = points
        return item

    def _framed(self, index: int) -> dict:
        frame = self.frame
        assert frame is not None  # only called with a frame
        case = self.cases[index]
        rng = self._rng(index)
        skull = np.asarray(self.data.points(case.defective), dtype=np.float64)
        implant_all = self.data.points(case.implant)
        implant = np.asarray(
            implant_all[
                np.sort(rng.choice(len(implant_all), self.n_implant, replace=len(implant_all) < self.n_implant))
            ]
        )
        estimate = self._estimate(index, skull)
        if self.atlas is None:
            if case.implant not in self._implant_means:
                self._implant_means[case.implant] = np.asarray(implant_all, dtype=np.float64).mean(axis=0)
            center = self._implant_means[case.implant]
        else:
            assert estimate is not None
            center = estimate.center
        if case.defective not in self._boxes:
            self._boxes[case.defective] = bbox_normalization(skull, self.half_extent)
        cond, norm = frame_condition(
            skull,
            center,
            self.n_skull,
            frame,
            rng,
            half_extent=self.half_extent,
            jitter=self.atlas is None,
            box=self._boxes[case.defective],
        )
        item = {
            "points": torch.from_numpy(norm.apply(np.concatenate([cond, implant]))),
            "center": torch.from_numpy(norm.center.astype(np.float32)),
            "scale": torch.tensor(norm.scale, dtype=torch.float32),
            "case_id": case.case_id,
        }
        if estimate is not None and self.atlas is not None and self.prior is not None:
            item["prior"] = torch.from_numpy(norm.apply(prior_points(estimate.points, self.n_implant, rng)))
        return item

    def _estimate(self, index: int, skull: np.ndarray) -> ImplantEstimate | None:
        """The case's atlas estimate (cached) from the atlas (validation); None without one (training)."""
        assert self.frame is not None
        if self.atlas is None:
            return None
        case = self.cases[index]
        if case.case_id not in self._estimates:
            agree = self.prior.agree if self.prior is not None else 0.5
            spacing = self.spacing(index).numpy()
            self._estimates[case.case_id] = atlas_estimate(self.atlas, skull, spacing, self.frame, agree)
        return self._estimates[case.case_id]

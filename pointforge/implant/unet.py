"""The volumetric U-Net peer: a defective skull of any grid in, an implant on that same grid out.

One pass (the task is :mod:`pointforge.tasks.unet`):

1. the defective skull goes onto the network's cube: ``grid``³ cells over its
   largest physical extent plus ``margin_mm`` per side, in LPS millimetres,
   as the bone fraction of each cell
   (:mod:`pointforge.data.skulls.coarse_grids`), so any spacing, field of
   view or orientation gives the cube the network was trained on;
2. the U-Net's implant probability on the cube;
3. that probability read trilinearly at each voxel's physical position of the
   input's own grid (anisotropic and oblique grids included), only inside the
   box where it can reach the threshold;
4. probability ≥ 0.5, minus the defective skull's bone, then every component
   of at least ``components`` of the largest kept
   (:func:`~pointforge.implant.postprocess.largest_component`; 0.2 as the
   PCDiff pipeline, which keeps both plates of a bilateral defect).

:func:`predict_implant` is that, arrays in and out; :func:`predict_case` and
:func:`score_case` run it on a prepared dataset's case (the demo's scoring);
:func:`generate_unet_case` writes a case folder as ``pointforge generate --unet``
does: ``implant.EXT`` on the input's grid, ``uncertainty.EXT`` (here the
network's probability, zero outside the implant's box), ``completed_skull``,
``implant.stl``, ``preview.png``, ``view.html`` and ``report.json``
(:mod:`pointforge.implant.writer`; ``proposals/implant_0`` is the implant
itself: one network pass is one proposal).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pointforge.data.skulls.coarse_grids import CubeFrame, box_around, field_on_volume, frame_around, occupancy
from pointforge.data.skulls.prepared import PreparedCase, PreparedDataset
from pointforge.data.volumes import Volume, read_binary_volume
from pointforge.errors import ConfigError, DataError, UserError
from pointforge.implant.metrics import evaluate_case
from pointforge.implant.models import named_flag
from pointforge.implant.pipeline import Generated
from pointforge.implant.postprocess import largest_component
from pointforge.implant.writer import check_label, write_case_folder
from pointforge.inference.unet import LoadedUNet, load_unet

__all__ = [
    "UNetPrediction",
    "load_generator",
    "predict",
    "predict_implant",
    "predict_case",
    "score_case",
    "generate_unet_case",
]

THRESHOLD = 0.5


@dataclass
class UNetPrediction:
    """One scan's implant (bool, the input's grid) and the probability it was cut from, inside ``box``."""

    implant: np.ndarray
    probability: np.ndarray  # float32 over ``box`` of the input's grid
    box: tuple[slice, ...] | None  # None: the probability reaches the threshold nowhere
    frame: CubeFrame
    timings: dict = field(default_factory=dict)

    def full_probability(self) -> np.ndarray:
        """The probability on the whole input grid (float32; zero outside ``box``)."""
        out = np.zeros(self.implant.shape, dtype=np.float32)
        if self.box is not None:
            out[self.box] = self.probability
        return out


def load_generator(checkpoint: str | os.PathLike, device: str = "auto") -> LoadedUNet:
    """:func:`~pointforge.inference.unet.load_unet` for ``generate --unet``: a missing file, or a checkpoint of
    another of generate's tasks, is one line naming the flag it belongs to."""
    if not Path(checkpoint).is_file():
        raise UserError(f"{checkpoint}: no such file; give a checkpoint written by `pointforge train unet`")
    with named_flag(checkpoint, "unet"):
        return load_unet(checkpoint, device)


def _check_components(components: float) -> None:
    if not 0 < components <= 1:
        raise ConfigError(f"--components must be a fraction in (0, 1], got {components}")


def predict(defective: Volume, loaded: LoadedUNet, *, components: float = 0.2) -> UNetPrediction:
    """The implant for ``defective`` (a bool :class:`Volume`, e.g. from read_binary_volume) on its own grid."""
    _check_components(components)
    if defective.data.ndim != 3 or defective.data.dtype != bool:
        raise DataError("the defective skull must be a 3-D binary (bool) volume; read it with read_binary_volume")
    if not defective.data.any():
        raise DataError("the defective skull volume is empty (no bone voxel)")
    cfg = loaded.config
    timings: dict[str, float] = {}
    t = time.perf_counter()
    frame = frame_around(defective, cfg.grid, cfg.margin_mm)
    image = torch.from_numpy(occupancy(defective, frame))[None, None].to(loaded.device)
    timings["to_cube_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        cube = torch.sigmoid(loaded.model(image).float())[0, 0].cpu().numpy()
    timings["network_s"] = time.perf_counter() - t
    t = time.perf_counter()
    implant = np.zeros(defective.shape, dtype=bool)
    box = box_around(cube, frame, defective, THRESHOLD)
    probability = np.zeros((0, 0, 0), dtype=np.float32)
    if box is not None:
        probability = field_on_volume(cube, frame, defective, box)
        candidate = (probability >= THRESHOLD) & ~defective.data[box]
        implant[box] = largest_component(candidate, components) if candidate.any() else candidate
    timings["to_input_s"] = time.perf_counter() - t
    return UNetPrediction(implant, probability, box, frame, timings)


def predict_implant(defective: Volume, loaded: LoadedUNet, *, components: float = 0.2) -> np.ndarray:
    """The implant mask (bool, ``defective``'s own grid) the U-Net predicts for ``defective`` (:func:`predict`)."""
    return predict(defective, loaded, components=components).implant


def _source(dataset: PreparedDataset, rel: str) -> Path:
    source = dataset.meta(rel).get("source")
    if not source:
        raise DataError(f"{dataset.path(rel)}: records no source volume; re-run `pointforge data prepare`")
    return Path(source)


def predict_case(
    dataset: PreparedDataset, case: PreparedCase, loaded: LoadedUNet, *, components: float = 0.2
) -> tuple[Volume, np.ndarray]:
    """A prepared case's defective skull (read from its raw volume) and the U-Net's implant on its grid."""
    defective = read_binary_volume(_source(dataset, case.defective))
    return defective, predict_implant(defective, loaded, components=components)


def score_case(
    dataset: PreparedDataset, case: PreparedCase, loaded: LoadedUNet, *, components: float = 0.2
) -> dict[str, Any]:
    """A prepared case predicted and scored against its true implant on its own grid: DSC, bDSC, HD95, HD.

    ``{"case_id", "defect", "dsc", "bdsc", "hd95", "hd", "notes", "error", "seconds"}``
    (:func:`~pointforge.implant.metrics.evaluate_case`: never raises for a bad prediction).
    """
    start = time.perf_counter()
    defective, implant = predict_case(dataset, case, loaded, components=components)
    seconds = time.perf_counter() - start
    truth = read_binary_volume(_source(dataset, case.implant), allow_empty=True)
    scores = evaluate_case(implant, truth.data, defective.data, truth.spacing)
    return {"case_id": case.case_id, "defect": case.defect, **scores, "seconds": seconds}


def describe(loaded: LoadedUNet) -> dict[str, Any]:
    """What report.json says about the model."""
    cfg = loaded.config
    return {
        "unet": {
            "checkpoint": loaded.source,
            "weights": loaded.weights,
            "step": loaded.step,
            "grid": cfg.grid,
            "margin_mm": cfg.margin_mm,
            "channels": list(cfg.channels),
            "strides": list(cfg.strides),
            "num_res_units": cfg.num_res_units,
        }
    }


def generate_unet_case(
    input_path: str | os.PathLike,
    out: str | os.PathLike,
    loaded: LoadedUNet,
    *,
    components: float = 0.2,
    overwrite: bool = False,
    label: float | None = None,
    title: str = "",
    preview: bool = True,
    view: bool = True,
    viewer_js: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The U-Net's implant for the defective skull at ``input_path``, every output written into the folder ``out``.

    As :func:`pointforge.implant.case.generate_case` for PCDiff (the same
    :func:`~pointforge.implant.writer.write_case_folder`): everything is written into a hidden sibling folder renamed to ``out`` once complete (a
    failure leaves ``out`` as it was); an existing ``out`` is refused unless
    ``overwrite``; masks carry ``label``, by default the input's own foreground
    value. Returns the report. Raises DataError when no implant is predicted.
    """
    say = log or (lambda _msg: None)
    check_label(label)
    _check_components(components)
    input_path, out = Path(input_path), Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it, or choose another --out")
    started = time.perf_counter()
    defective = read_binary_volume(input_path)
    read_s = time.perf_counter() - started
    found = predict(defective, loaded, components=components)
    if not found.implant.any():
        raise DataError(
            "the U-Net predicts no implant for this skull (probability below 0.5 everywhere outside the bone); "
            "check that the input has a defect, or train the model longer"
        )
    frame = found.frame
    say(
        f"U-Net on a {frame.size}³ cube of {frame.cell_mm:.2f} mm cells: implant of {int(found.implant.sum())} voxels "
        f"({sum(found.timings.values()):.1f} s)"
    )
    result = Generated(
        defective=defective,
        implant=found.implant,
        proposals=[found.implant],
        agreement=found.full_probability(),
        implant_points=np.zeros((1, 0, 3), dtype=np.float32),
        timings={"read_s": read_s, **found.timings},
        notes=[
            f"U-Net on a {frame.size}³ cube of {frame.cell_mm:.3g} mm cells, its probability mapped to the input grid",
            "uncertainty and 'agreement' hold the U-Net's probability of implant (one pass: one proposal)",
        ],
    )
    report: dict[str, Any] = {
        "input": str(input_path),
        "title": title or f"{input_path.name}: U-Net implant",
        "parameters": {
            "method": "unet",
            "components": components,
            "threshold": THRESHOLD,
            "cube": frame.as_dict(),
            "device": str(loaded.device),
        },
        "models": describe(loaded),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_case_folder(
        result,
        out,
        report,
        input_path=input_path,
        started=started,
        label=label,
        viewer_js=viewer_js,
        preview=preview,
        view=view,
    )
    return report

"""One case from its file to its folder: read, :mod:`~pointforge.implant.pipeline`, :mod:`~pointforge.implant.writer`.

The flow runs one way: what can be refused without the input (the label, the
sampler, an existing ``out``) is refused first; the input is read; the pipeline
makes the implant in memory; the writer writes it all, atomically. The options
were checked when they were made (:class:`~pointforge.implant.options.GenerateOptions`)
and the sampler is built once, here, for the pipeline to run.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pointforge.data.dicom import CTSeries, read_skull_input
from pointforge.errors import UserError
from pointforge.implant.models import Models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.pipeline import Progress, build_sampler, generate_implant
from pointforge.implant.timing import timed
from pointforge.implant.writer import check_label, write_case_folder

__all__ = ["generate_case"]


def generate_case(
    input_path: str | os.PathLike,
    out: str | os.PathLike,
    models: Models,
    options: GenerateOptions | None = None,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    title: str = "",
    proposals_mm: np.ndarray | None = None,
    label: float | None = None,
    viewer_js: str | os.PathLike | None = None,
    preview: bool = True,
    view: bool = True,
) -> dict:
    """Generate the implant for the defective skull at ``input_path`` into the folder ``out``.

    ``input_path`` is a binary mask (NRRD/NIfTI) or a CT series (a folder or zip
    of DICOM files, :func:`~pointforge.data.dicom.read_ct_series`); a series
    also gets its implant as a DICOM Segmentation and Encapsulated STL.

    All outputs are written into a hidden sibling folder that is renamed to
    ``out`` only once complete; a failure leaves ``out`` as it was. An existing
    ``out`` is refused unless ``overwrite``. Masks are written with ``label``
    as foreground, by default the input's own foreground value. view.html loads
    plotly.js from ``viewer_js`` (written there if missing; default: inside
    ``out``). ``preview=False`` skips preview.png, ``view=False`` view.html (``pointforge view``
    writes it from the folder later). Returns the report.
    """
    options = options or GenerateOptions()
    check_label(label)
    input_path, out = Path(input_path), Path(out)
    sampler = build_sampler(models, options)  # a sampler/steps mismatch fails before any work
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it, or choose another --out")
    started = time.perf_counter()
    (defective, series), read_s = timed(lambda: read_skull_input(input_path))
    result = generate_implant(
        defective, models, options, sampler=sampler, log=log, progress=progress, proposals_mm=proposals_mm
    )
    result.timings = {"read_s": read_s, **result.timings}
    report: dict[str, Any] = {
        "input": str(input_path),
        "title": title or f"{input_path.name}: generated implant",
        "parameters": {**asdict(options), "sampler_steps": sampler.num_steps, "device": str(models.device)},
        "seed": options.seed,
        "models": models.describe(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if series is not None:
        report["dicom"] = _series_record(series)
    return write_case_folder(
        result,
        out,
        report,
        input_path=input_path,
        started=started,
        label=label,
        viewer_js=viewer_js,
        preview=preview,
        view=view,
        dicom_sources=series.headers if series is not None else None,
    )


def _series_record(series: CTSeries) -> dict:
    first = series.headers[0]
    return {
        "frame_of_reference_uid": series.frame_of_reference_uid,
        "study_instance_uid": str(first.get("StudyInstanceUID", "")),
        "series_instance_uid": str(first.get("SeriesInstanceUID", "")),
        "slices": len(series.headers),
        "notes": series.notes,
    }

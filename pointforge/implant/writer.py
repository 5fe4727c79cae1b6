"""One case's folder: the pipeline's results written, atomically, beside a report.

Everything goes into a temporary sibling folder renamed into place at the end, so
a folder under the final name is always complete (:func:`write_case_folder`; a
case from its input file on is :func:`pointforge.implant.case.generate_case`).

Outputs of one case (``EXT`` is the input's: NRRD in → NRRD out, NIfTI → NIfTI):

* ``implant.EXT`` — mask on the input's grid, written with the input's
  foreground value (a 0/255 skull gives a 0/255 implant; ``label`` chooses
  another; report.json's ``label`` says which) with its exact shape, spacing,
  origin, direction and kept header fields;
* ``implant.stl`` — the implant surface in millimetres in the input's physical
  space (its affine), watertight, normals outward (voxels touching only along an
  edge or a corner are joined by one filled voxel first, so the surface is a
  closed manifold; the report counts them);
* ``proposals/implant_K.EXT`` — each proposal's own implant;
* ``proposals/points.npy`` — the generated implant points, ``[n, P, 3]`` float32
  voxel indices of the input grid;
* ``uncertainty.EXT`` — float32, the fraction of proposals whose implant holds the
  voxel (1 = all agree it is implant, 0 = none; in-between values mark where
  the proposals disagree);
* ``completed_skull.EXT`` — defective skull ∪ implant;
* ``preview.png`` — skull and implant from four surgical views, the implant
  coloured by agreement (unless ``preview=False``: a service that shows the
  3-D view skips this, the slowest file to write);
* ``view.html`` — the same turnable in a web browser, offline, each proposal
  switchable (:mod:`pointforge.implant.view`); it loads ``plotly.min.js`` from
  beside it, or from the dataset's root in folder mode (one copy for all cases)
  (unless ``view=False``: ``pointforge view`` writes it from the folder later);
* ``report.json`` — parameters, seed, models, timings per stage, implant volume,
  mesh checks, agreement statistics, versions.

For a CT series in (a DICOM folder or zip, :mod:`pointforge.data.dicom`) the
volumes are NRRD on the skull's isotropic grid in the series' patient
coordinates, and two DICOM files in the CT's Frame of Reference join them
(:mod:`pointforge.implant.dicom_out`): ``implant_seg.dcm`` (a Segmentation) and
``implant_stl.dcm`` (the mesh as Encapsulated STL); report.json's ``dicom``
says which series they reference and what was done to read it.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pointforge import __version__
from pointforge.atomic import atomic_write_text
from pointforge.data.surface import make_well_composed
from pointforge.data.volumes import Volume, volume_format, write_volume
from pointforge.devices import available_cores
from pointforge.errors import UserError
from pointforge.formats import json_safe
from pointforge.implant.dicom_out import SEG_FILE, STL_DICOM_FILE, write_encapsulated_stl, write_segmentation
from pointforge.implant.export import Layer, render_preview
from pointforge.implant.pipeline import Generated
from pointforge.implant.timing import timed
from pointforge.implant.view import PLOTLY_JS, ViewLayers, view_html, write_plotly_js
from pointforge.implant.voxelize import field_to_mesh

__all__ = ["REPORT", "suffix_of", "check_label", "labelled", "write_case", "write_case_folder", "case_done"]

REPORT = "report.json"


def suffix_of(path: Path) -> str:
    """The outputs' extension: the input's volume format (NRRD in, NRRD out; NIfTI in, NIfTI out; DICOM: NRRD)."""
    if Path(path).is_dir() or str(path).lower().endswith(".zip"):
        return ".nrrd"
    return (
        ".nii.gz" if str(path).lower().endswith(".nii.gz") else (".nii" if volume_format(path) == "nifti" else ".nrrd")
    )


def _mesh_checks(mesh) -> dict:
    import trimesh

    components = trimesh.graph.connected_components(mesh.face_adjacency, nodes=np.arange(len(mesh.faces)))
    watertight = bool(mesh.is_watertight)
    return {
        "watertight": watertight,
        "winding_consistent": bool(mesh.is_winding_consistent),
        "outward_normals": bool(watertight and mesh.volume > 0),
        "components": int(len(components)),
        "vertices": int(len(mesh.vertices)),
        "faces": int(len(mesh.faces)),
        "volume_cm3": round(float(mesh.volume) / 1000.0, 3) if watertight else None,
        "units": "mm",
    }


def _versions() -> dict:
    import scipy
    import skimage
    import trimesh

    return {
        "pointforge": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "scikit-image": skimage.__version__,  # type: ignore[attr-defined]  # set by skimage's lazy loader
        "trimesh": trimesh.__version__,
        # The CPU Poisson solve's FFTs and the compiled evaluation kernels (absent: their torch paths ran).
        "ducc0": _installed("ducc0"),
        "numba": _installed("numba"),
        "python": platform.python_version(),
    }


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def labelled(mask: np.ndarray, label: float) -> np.ndarray:
    """``mask`` as 0/``label`` voxels, in the smallest unsigned type that holds ``label`` (float32 if not whole)."""
    if float(label).is_integer() and 0 < label < 2**32:
        dtype = np.min_scalar_type(int(label))
        return mask.astype(dtype) * dtype.type(int(label))
    return mask.astype(np.float32) * np.float32(label)


def _agreement(result: Generated) -> np.ndarray:
    """The case's agreement map; a result generated without it (``each=False``: scoring only) cannot be written."""
    if result.agreement is None:
        raise ValueError("this result has no agreement map (generated with each=False); generate it with each=True")
    return result.agreement


def _volume_job(path: Path, ref: Volume, data: Callable[[], np.ndarray]) -> Callable[[], Any]:
    """Write ``data()`` on ``ref``'s grid to ``path`` when called (the array is made in the worker, not before)."""
    return lambda: write_volume(path, ref.with_data(data()))


def _volume_jobs(result: Generated, folder: Path, files: dict, label: float) -> list[Callable[[], Any]]:
    """One callable per volume file (and the points), the largest first."""
    ref = result.defective
    jobs: list[Callable[[], Any]] = [
        _volume_job(folder / files["uncertainty"], ref, lambda: _agreement(result).astype(np.float32, copy=False)),
        _volume_job(folder / files["completed_skull"], ref, lambda: labelled(result.completed, label)),
        _volume_job(folder / files["implant"], ref, lambda: labelled(result.implant, label)),
        lambda: np.save(folder / files["points"], result.implant_points),
    ]
    for rel, mask in zip(files["proposals"], result.proposals):
        jobs.append(_volume_job(folder / rel, ref, partial(labelled, mask, label)))
    return jobs


def _write_preview(result: Generated, folder: Path, files: dict, title: str) -> None:
    """preview.png: four fixed views, the implant coloured by agreement."""
    ref = result.defective
    render_preview(
        folder / files["preview"],
        [
            Layer(ref.data, (0.89, 0.85, 0.76), 1.0, "defective skull"),
            Layer(
                result.implant,
                (0.95, 0.45, 0.1),
                1.0,
                "implant (colour: agreement of proposals, yellow = all)",
                values=_agreement(result),
                cmap="plasma",
            ),
        ],
        spacing=(float(ref.spacing[0]), float(ref.spacing[1]), float(ref.spacing[2])),
        title=title,
    )


def _write_view(result: Generated, folder: Path, files: dict, title: str, js_src: str) -> None:
    """view.html: turnable, loading plotly.js from ``js_src``."""
    ref = result.defective
    layers = ViewLayers(
        ref, ref.data, result.implant, result.agreement, list(result.proposals), title, skull_mesh=result.skull_mesh
    )
    atomic_write_text(folder / files["view"], view_html(layers, js_src))


def write_case(
    result: Generated,
    folder: Path,
    *,
    suffix: str,
    report: dict,
    label: float = 1,
    js_src: str = PLOTLY_JS,
    preview: bool = True,
    view: bool = True,
    dicom_sources: list | None = None,
) -> dict:
    """Write every output of one case into ``folder`` (which the caller renames into place);
    returns ``report`` completed with what was written. The caller writes report.json last.

    Masks are written as 0/``label``; view.html loads plotly.js from ``js_src``
    (relative to the case's final folder; ``plotly.min.js``, the default, is
    written into ``folder`` itself). With ``dicom_sources`` (the CT slices' headers),
    the implant is also written as a DICOM Segmentation and the mesh as Encapsulated STL."""
    t = time.perf_counter()
    _agreement(result)  # refused before anything is written
    ref = result.defective
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {
        "implant": f"implant{suffix}",
        "uncertainty": f"uncertainty{suffix}",
        "completed_skull": f"completed_skull{suffix}",
        "mesh": "implant.stl",
        **({"preview": "preview.png"} if preview else {}),
        **({"view": "view.html"} if view else {}),
        "proposals": [f"proposals/implant_{k}{suffix}" for k in range(len(result.proposals))],
        "points": "proposals/points.npy",
        **({"seg": SEG_FILE, "stl_dicom": STL_DICOM_FILE} if dicom_sources else {}),
    }
    (folder / files["points"]).parent.mkdir(parents=True, exist_ok=True)
    # The files are independent: compressing volumes (zlib and NumPy copies release the GIL)
    # overlaps with the meshes and pictures, one thread per available core.
    title = report.get("title", "")
    with ThreadPoolExecutor(max_workers=available_cores()) as pool:
        jobs = {
            "view": [pool.submit(timed, partial(_write_view, result, folder, files, title, js_src))] if view else [],
            "preview": [pool.submit(timed, partial(_write_preview, result, folder, files, title))] if preview else [],
            "volumes": [pool.submit(timed, job) for job in _volume_jobs(result, folder, files, label)],
        }
        mesh_start = time.perf_counter()
        # A printable mesh must be a closed 2-manifold: implant voxels that touch only
        # along an edge or at a corner give marching cubes non-manifold edges. The
        # mesh is made from the implant with one voxel filled per such configuration
        # (a handful, at the rim; counted in the report); the NRRD keeps the implant
        # itself, disjoint from the skull.
        solid = make_well_composed(result.implant.copy())
        mesh = field_to_mesh(solid, ref)
        mesh.export(folder / files["mesh"], file_type="stl")
        if dicom_sources:
            jobs["dicom"] = [
                pool.submit(timed, partial(_write_dicom, result, mesh, folder, files, title, dicom_sources))
            ]
        if view and js_src == PLOTLY_JS:
            write_plotly_js(folder / PLOTLY_JS)
        parts = {"mesh": time.perf_counter() - mesh_start}
        parts.update({name: sum(job.result()[1] for job in group) for name, group in jobs.items() if group})
    result.timings["write_s"] = time.perf_counter() - t
    # Each part's own seconds; they ran side by side, so they add up to more than write_s.
    result.timings.update({f"write_{name}_s": seconds for name, seconds in parts.items()})
    report.update(_case_summary(result, files, mesh, solid))
    return report


def _write_dicom(result: Generated, mesh, folder: Path, files: dict, title: str, sources: list) -> None:
    """implant_seg.dcm and implant_stl.dcm, in the CT's Frame of Reference (the skull's grid is in its LPS)."""
    implant = result.defective.with_data(result.implant)
    write_segmentation(folder / files["seg"], implant, sources, description=title or "pointforge implant")
    stl = (folder / files["mesh"]).read_bytes()
    write_encapsulated_stl(folder / files["stl_dicom"], stl, sources, description=title or "pointforge implant")


def _case_summary(result: Generated, files: dict, mesh, solid: np.ndarray) -> dict:
    ref = result.defective
    spacing = [float(s) for s in ref.spacing]
    inside = _agreement(result)[result.implant]
    voxel_mm3 = float(np.prod(spacing))
    return {
        "outputs": files,
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "implant": {
            "voxels": int(result.implant.sum()),
            "volume_cm3": round(int(result.implant.sum()) * voxel_mm3 / 1000.0, 3),
            "shape": list(ref.shape),
            "spacing_mm": spacing,
            "origin_mm": [float(o) for o in ref.origin],
        },
        "mesh": {**_mesh_checks(mesh), "voxels_filled_for_manifold": int(solid.sum() - result.implant.sum())},
        "agreement": {
            "meaning": "fraction of proposals whose own implant contains the voxel",
            "mean_in_implant": round(float(inside.mean()), 4) if inside.size else None,
            "unanimous_fraction_in_implant": round(float((inside >= 1.0).mean()), 4) if inside.size else None,
        },
        "notes": result.notes,
        "versions": _versions(),
    }


def _partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _remove_stale_partials(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def case_done(out: Path) -> bool:
    """A case folder is complete exactly when its report.json exists (written last, then renamed in)."""
    return (out / REPORT).is_file()


def write_case_folder(
    result: Generated,
    out: Path,
    report: dict,
    *,
    input_path: Path,
    started: float,
    label: float | None = None,
    viewer_js: str | os.PathLike | None = None,
    preview: bool = True,
    view: bool = True,
    dicom_sources: list | None = None,
) -> dict:
    """Every output of one case, report.json last, into a hidden sibling of ``out`` renamed to ``out`` once
    complete; a failure leaves ``out`` as it was. Returns ``report`` completed.

    Outputs take ``input_path``'s format; masks are written with ``label`` as
    foreground, by default the input's own. view.html loads plotly.js from
    ``viewer_js`` (written there if missing; default: inside ``out``).
    ``started`` (``time.perf_counter()`` when the case began) gives ``total_s``.
    """
    report["label"] = _label_record(label, result.defective.foreground)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    partial = _partial_dir(out)
    js_src = PLOTLY_JS
    if view and viewer_js is not None:
        js_src = Path(os.path.relpath(write_plotly_js(viewer_js).resolve(), out.resolve())).as_posix()
    try:
        write_case(
            result,
            partial,
            suffix=suffix_of(input_path),
            report=report,
            label=report["label"]["value"],
            js_src=js_src,
            preview=preview,
            view=view,
            dicom_sources=dicom_sources,
        )
        report["timings_s"]["total_s"] = round(time.perf_counter() - started, 3)
        (partial / REPORT).write_text(json.dumps(json_safe(report), indent=1))
        _move_into_place(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return report


def _move_into_place(partial: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, out)


def check_label(label: float | None) -> None:
    """UserError unless ``label`` is None (the input's own) or a positive number."""
    if label is not None and not (isinstance(label, (int, float)) and math.isfinite(label) and label > 0):
        raise UserError(f"--label must be a positive number (the value of implant voxels), got {label!r}")


def _label_record(label: float | None, foreground: float | None) -> dict:
    """The foreground value written into the masks, and where it came from."""
    if label is not None:
        value, source = label, "--label"
    elif foreground is not None:
        value, source = foreground, "the input's foreground value"
    else:
        value, source = 1, "default (the input is boolean)"
    value = int(value) if float(value).is_integer() else float(value)
    return {"value": value, "from": source, "applies_to": ["implant", "proposals", "completed_skull"]}

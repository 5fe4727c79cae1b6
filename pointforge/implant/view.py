"""An interactive 3-D view of one case: ``view.html``, a web page that works offline.

The page shows the defective skull (bone colour), the implant coloured by the
proposals' agreement (the value of ``uncertainty.EXT`` on its surface: plasma
colours, yellow = every proposal holds the voxel) and each proposal's own
implant, off at first and switched on and off by clicking its name in the
legend. Coordinates are millimetres in the scan's physical space (its affine,
as the STL); the page turns (drag), zooms (scroll) and pans (right-drag).

It is drawn by plotly.js (https://plotly.com/javascript/), whose bundled
JavaScript ships inside the ``plotly`` Python package: it is written once
beside the pages (``plotly.min.js``, about 4.8 MB) and each page loads it by a
relative path, so nothing is fetched from the network and a folder of cases
holds one copy. Surfaces are the marching-cubes surfaces of the masks (the
STL's; a mask wider than :data:`MAX_GRID` voxels marched on blocks of voxels),
decimated by quadric error (fast-simplification, through trimesh) to at most
:data:`FACE_BUDGET` faces per layer, so a page stays a few MB whatever the grid.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pointforge.atomic import atomic_write_bytes, atomic_write_text
from pointforge.data.surface import bounding_box, decimate, downsample_mask, volume_to_mesh
from pointforge.data.volumes import Volume, read_binary_volume, read_volume
from pointforge.errors import DataError

__all__ = [
    "PLOTLY_JS",
    "FACE_BUDGET",
    "ViewLayers",
    "view_html",
    "write_plotly_js",
    "write_view",
    "case_layers",
    "file_layers",
]

PLOTLY_JS = "plotly.min.js"
FACE_BUDGET = {"skull": 50_000, "implant": 20_000, "proposal": 5_000}
# Masks wider than this are marched on blocks of voxels (surface_mm); 256 keeps a skull's blocks under its
# thickness at the scanners' 0.4-0.5 mm and its marched faces about 13 times the page's 50,000.
MAX_GRID = 256
BONE = "rgb(227,217,194)"
IMPLANT = "rgb(242,115,25)"  # an implant without agreement values (a bare implant file)
PROPOSAL_COLOURS = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f")
_LIGHT = {"ambient": 0.45, "diffuse": 0.8, "specular": 0.05, "roughness": 0.9}


@dataclass
class ViewLayers:
    """What one page shows: masks on ``reference``'s grid (whose affine maps them to mm)."""

    reference: Volume
    skull: np.ndarray
    implant: np.ndarray
    agreement: np.ndarray | None = None  # float in [0, 1] on the grid; None: implant in one colour
    proposals: list[np.ndarray] = field(default_factory=list)
    title: str = ""
    skull_mesh: tuple[np.ndarray, np.ndarray] | None = None  # volume_to_mesh(skull), if already marched


def surface_mm(
    mask: np.ndarray, reference: Volume, max_faces: int, mesh: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertices in voxel indices, the same in mm, faces) of ``mask``'s surface, at most ``max_faces`` faces.

    ``mesh`` is ``volume_to_mesh(mask)`` where the caller has it already (it is not marched again). A mask
    whose box is wider than :data:`MAX_GRID` voxels is marched on blocks of voxels instead (its mesh is
    not used): a skull at 0.45 mm gives 2.6 M faces, whose decimation to the page's 50,000 took 9 of the
    page's 17 seconds; the decimated surface is as coarse either way."""
    box = bounding_box(mask, margin=1)
    if box is None:
        raise DataError("the mask is empty; there is no surface to show")
    if max(b.stop - b.start for b in box) > MAX_GRID:
        small, factor = downsample_mask(mask[box], MAX_GRID)
        verts, faces = volume_to_mesh(small)
        # A block's centre is the mean of its voxels' indices.
        verts = verts * factor + (factor - 1) / 2 + np.asarray([b.start for b in box], dtype=np.float64)
    else:
        verts, faces = mesh if mesh is not None else volume_to_mesh(mask)
    verts, faces = decimate(verts, faces, max_faces)
    return verts, reference.voxel_to_physical(verts), faces


def _agreement_at(verts: np.ndarray, implant: np.ndarray, agreement: np.ndarray) -> np.ndarray:
    """The agreement of the implant voxel each surface vertex bounds (vertices lie between voxels)."""
    from scipy.ndimage import grey_dilation

    # Only the implant's box (two voxels of zeros around it) is dilated: every vertex lies within a
    # voxel of the implant, and outside the box the agreement inside the implant is 0 anyway.
    box = bounding_box(implant, margin=2)
    if box is None:
        return np.zeros(len(verts), dtype=np.float32)
    inside = np.where(implant[box], agreement[box], 0.0).astype(np.float32)
    near = grey_dilation(inside, size=(3, 3, 3))
    start = np.asarray([b.start for b in box])
    idx = np.clip(np.rint(verts).astype(np.int64), 0, np.asarray(implant.shape) - 1) - start
    idx = np.clip(idx, 0, np.asarray(near.shape) - 1)
    return near[idx[:, 0], idx[:, 1], idx[:, 2]]


def _mesh_trace(verts_mm: np.ndarray, faces: np.ndarray, name: str, **style) -> dict:
    xyz = verts_mm.astype(np.float32)
    tri = faces.astype(np.int32)
    return {
        "type": "mesh3d",
        "name": name,
        "x": xyz[:, 0],
        "y": xyz[:, 1],
        "z": xyz[:, 2],
        "i": tri[:, 0],
        "j": tri[:, 1],
        "k": tri[:, 2],
        "showlegend": True,
        "lighting": _LIGHT,
        "hoverinfo": "name",
        **style,
    }


def _implant_trace(layers: ViewLayers) -> dict:
    verts, mm, faces = surface_mm(layers.implant, layers.reference, FACE_BUDGET["implant"])
    if layers.agreement is None:
        return _mesh_trace(mm, faces, "implant", color=IMPLANT)
    n = len(layers.proposals)
    return _mesh_trace(
        mm,
        faces,
        "implant (colour: agreement)",
        intensity=_agreement_at(verts, layers.implant, layers.agreement),
        colorscale="Plasma",
        cmin=0.0,
        cmax=1.0,
        colorbar={"title": {"text": f"agreement of<br>{n} proposals" if n else "agreement"}, "len": 0.6},
    )


def _traces(layers: ViewLayers) -> list[dict]:
    traces = []
    if layers.skull.any():
        _, mm, faces = surface_mm(layers.skull, layers.reference, FACE_BUDGET["skull"], layers.skull_mesh)
        traces.append(_mesh_trace(mm, faces, "defective skull", color=BONE))
    if layers.implant.any():
        traces.append(_implant_trace(layers))
    for k, mask in enumerate(layers.proposals):
        if mask.any():
            _, mm, faces = surface_mm(mask, layers.reference, FACE_BUDGET["proposal"])
            colour = PROPOSAL_COLOURS[k % len(PROPOSAL_COLOURS)]
            traces.append(_mesh_trace(mm, faces, f"proposal {k}", color=colour, opacity=0.6, visible="legendonly"))
    return traces


def _figure(layers: ViewLayers):
    import plotly.graph_objects as go

    axis = {"backgroundcolor": "white", "gridcolor": "#dddddd", "showbackground": True}
    title = layers.title + ("<br><sub>" if layers.title else "") + "drag: turn, scroll: zoom, right-drag: pan; "
    title += "click a name to show or hide it" + ("</sub>" if layers.title else "")
    fig = go.Figure(data=_traces(layers))
    fig.update_layout(
        title={"text": title, "x": 0.02},
        paper_bgcolor="white",
        margin={"l": 0, "r": 0, "t": 70, "b": 0},
        legend={"x": 0.01, "y": 0.92, "bgcolor": "rgba(255,255,255,0.7)"},
        scene={
            "aspectmode": "data",
            "xaxis": {**axis, "title": {"text": "x (mm)"}},
            "yaxis": {**axis, "title": {"text": "y (mm)"}},
            "zaxis": {**axis, "title": {"text": "z (mm)"}},
            "camera": {"eye": {"x": 0.0, "y": -1.9, "z": 0.9}},
        },
    )
    return fig


def view_html(layers: ViewLayers, js_src: str = PLOTLY_JS) -> str:
    """The page, loading plotly.js from ``js_src`` (a path relative to the page)."""
    import plotly.io as pio

    if not (layers.skull.any() or layers.implant.any()):
        raise DataError("nothing to show: the skull and the implant are both empty")
    return pio.to_html(
        _figure(layers),
        include_plotlyjs=js_src,
        full_html=True,
        default_width="100%",
        default_height="100vh",
        config={"displaylogo": False, "responsive": True},
    )


def write_plotly_js(path: str | os.PathLike) -> Path:
    """plotly.js, bundled with the plotly package, at ``path`` (left alone if already there, same size)."""
    from plotly.offline import get_plotlyjs

    path = Path(path)
    code = get_plotlyjs().encode("utf-8")
    if not (path.is_file() and path.stat().st_size == len(code)):
        atomic_write_bytes(path, code)
    return path


def write_view(page: str | os.PathLike, layers: ViewLayers, *, js: str | os.PathLike | None = None) -> Path:
    """Write the page at ``page`` and plotly.js at ``js`` (default: beside the page) if it is not there yet."""
    page = Path(page)
    js_path = Path(js) if js is not None else page.parent / PLOTLY_JS
    write_plotly_js(js_path)
    src = Path(os.path.relpath(js_path.resolve(), page.parent.resolve())).as_posix()
    atomic_write_text(page, view_html(layers, src))
    return page


def case_layers(case_dir: str | os.PathLike) -> ViewLayers:
    """The layers of a folder written by ``pointforge generate`` (its report.json names the files)."""
    case_dir = Path(case_dir)
    try:
        report = json.loads((case_dir / "report.json").read_text())
        outputs = report["outputs"]
    except (OSError, ValueError, KeyError):
        raise DataError(
            f"{case_dir}: not a case folder written by pointforge generate (no readable report.json); "
            "for other files use: pointforge view IMPLANT --skull DEFECTIVE"
        ) from None
    completed = read_binary_volume(case_dir / outputs["completed_skull"])
    implant = read_binary_volume(case_dir / outputs["implant"], allow_empty=True).data
    agreement = read_volume(case_dir / outputs["uncertainty"]).data.astype(np.float32)
    proposals = [read_binary_volume(case_dir / p, allow_empty=True).data for p in outputs.get("proposals", [])]
    return ViewLayers(
        reference=completed,
        skull=completed.data & ~implant,
        implant=implant,
        agreement=agreement,
        proposals=proposals,
        title=report.get("title", case_dir.name),
    )


def file_layers(implant_path: str | os.PathLike, skull_path: str | os.PathLike) -> ViewLayers:
    """An implant file and the defective skull it fills (same grid), the implant in one colour."""
    implant = read_binary_volume(implant_path, allow_empty=True)
    skull = read_binary_volume(skull_path)
    if implant.shape != skull.shape or not np.allclose(implant.spacing, skull.spacing, rtol=1e-4):
        raise DataError(
            f"{implant_path} (shape {implant.shape}, spacing {implant.spacing}) and {skull_path} "
            f"(shape {skull.shape}, spacing {skull.spacing}) are not on one grid; give the skull the implant was made for"
        )
    return ViewLayers(
        reference=skull, skull=skull.data & ~implant.data, implant=implant.data, title=Path(implant_path).name
    )

"""Meshes and previews of skulls and implants.

Previews are rendered with matplotlib's 3-D polygons (no display needed): each
layer is a binary volume turned into a shaded surface mesh. Volumes are
down-sampled to at most ``max_grid`` voxels per side first and each surface
decimated to at most ``max_faces`` triangles, so a 512³ case renders in
seconds; the preview is for looking, not measuring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pointforge.atomic import atomic_path
from pointforge.data.surface import decimate, downsample_mask, volume_to_mesh

# (elevation, azimuth, title) for matplotlib's view_init. With the synthetic
# skulls' convention (axis 0 left→right, axis 1 anterior→posterior, axis 2
# inferior→superior) these are the views a surgeon plans from.
SURGICAL_VIEWS = (
    (10, -90, "anterior"),
    (10, 180, "right lateral"),
    (10, 0, "left lateral"),
    (80, -90, "superior"),
)

# Faces per layer in a preview: matplotlib sorts and draws every triangle in every panel (its time grows with
# them), and a panel a few hundred pixels wide shows no more.
PREVIEW_FACES = 30_000


@dataclass
class Layer:
    mask: np.ndarray
    color: tuple[float, float, float]
    alpha: float = 1.0
    label: str = ""
    values: np.ndarray | None = None  # optional per-voxel scalar in [0,1] to colour by (e.g. uncertainty)
    cmap: str = "plasma"


def _smooth_mesh(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Surface of a lightly smoothed mask: no voxel staircase in the picture."""
    from scipy.ndimage import gaussian_filter
    from skimage.measure import marching_cubes

    field = gaussian_filter(np.pad(mask.astype(np.float32), 2), sigma=1.0)
    if field.max() < 0.5:
        return volume_to_mesh(mask)
    verts, faces, _, _ = marching_cubes(field, level=0.5, allow_degenerate=False)
    return verts - 2.0, faces


def _shade(verts: np.ndarray, faces: np.ndarray, base: np.ndarray) -> np.ndarray:
    tri = verts[faces]
    normals = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
    normals /= np.linalg.norm(normals, axis=1, keepdims=True) + 1e-12
    light = np.array([0.3, -0.6, 0.75])
    light /= np.linalg.norm(light)
    lam = 0.35 + 0.65 * np.abs(normals @ light)
    return np.clip(base * lam[:, None], 0, 1)


def _layer_meshes(layers: list[Layer], spacing, max_grid: int, max_faces: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Each non-empty layer's triangles (mm, at most ``max_faces``) with shaded RGBA colours, and the bounds
    of all their vertices."""
    from matplotlib import colormaps

    meshes = []
    lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
    for layer in layers:
        if not layer.mask.any():
            continue
        small, factor = downsample_mask(layer.mask, max_grid)
        if not small.any():
            continue
        verts, faces = decimate(*_smooth_mesh(small), max_faces)
        verts = (verts * factor) * np.asarray(spacing)
        if layer.values is not None:
            vals_small = layer.values[::factor, ::factor, ::factor]
            centre = np.clip(
                np.round(verts[faces].mean(1) / np.asarray(spacing) / factor).astype(int),
                0,
                np.asarray(vals_small.shape) - 1,
            )
            base = np.asarray(colormaps[layer.cmap](vals_small[tuple(centre.T)]))[:, :3]
        else:
            base = np.broadcast_to(np.asarray(layer.color, float), (len(faces), 3))
        colors = np.concatenate([_shade(verts, faces, base), np.full((len(faces), 1), layer.alpha)], axis=1)
        meshes.append((verts[faces], colors, layer))
        lo, hi = np.minimum(lo, verts.min(0)), np.maximum(hi, verts.max(0))
    if not meshes:
        raise ValueError("nothing to render: every layer is empty")
    return meshes, lo, hi


def _draw_views(fig, meshes: list, views, centre: np.ndarray, half: float) -> None:
    """One 3-D panel per view, every mesh in each, all on the same cube around ``centre``."""
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    # One collection of every layer's triangles: mplot3d sorts triangles by depth within a collection but
    # draws whole collections in one order per panel, which hid the implant behind the skull from above.
    tris = np.concatenate([t for t, _, _ in meshes])
    colors = np.concatenate([c for _, c, _ in meshes])
    for k, (elev, azim, name) in enumerate(views):
        ax = fig.add_subplot(1, len(views), k + 1, projection="3d")
        ax.add_collection3d(Poly3DCollection(tris, facecolors=colors, edgecolors="none", linewidths=0))
        for i, setter in enumerate((ax.set_xlim, ax.set_ylim, ax.set_zlim)):
            setter(centre[i] - half, centre[i] + half)
        ax.set_box_aspect((1, 1, 1))
        ax.view_init(elev=elev, azim=azim)
        ax.set_axis_off()
        ax.set_title(name, fontsize=10)


def render_preview(
    path: str | os.PathLike,
    layers: list[Layer],
    *,
    spacing: tuple[float, float, float] = (1.0, 1.0, 1.0),
    views=SURGICAL_VIEWS,
    title: str = "",
    max_grid: int = 128,
    max_faces: int = PREVIEW_FACES,
    dpi: int = 90,
) -> Path:
    """Write a PNG with one panel per view showing every layer's surface. Atomic."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    meshes, lo, hi = _layer_meshes(layers, spacing, max_grid, max_faces)
    fig = plt.figure(figsize=(4 * len(views), 4.4), dpi=dpi)
    _draw_views(fig, meshes, views, (lo + hi) / 2, (hi - lo).max() / 2 * 1.05)
    handles = [plt.Rectangle((0, 0), 1, 1, color=layer.color) for _, _, layer in meshes if layer.label]
    if handles:
        fig.legend(
            handles,
            [layer.label for _, _, layer in meshes if layer.label],
            loc="lower center",
            ncol=len(handles),
            frameon=False,
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # tight_layout leaves a placeholder layout engine, for which savefig would draw every panel once
    # more before drawing it for real; the layout is done, so the figure is left without one.
    fig.set_layout_engine(None)
    path = Path(path)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def skull_preview(path, defective: np.ndarray, implant: np.ndarray | None, spacing, *, title: str = "") -> Path:
    """Defective skull in bone colour and the implant (the defect) in orange."""
    layers = [Layer(defective, (0.89, 0.85, 0.76), 1.0, "defective skull")]
    if implant is not None and implant.any():
        layers.append(Layer(implant, (0.95, 0.45, 0.1), 1.0, "implant"))
    return render_preview(path, layers, spacing=spacing, title=title)

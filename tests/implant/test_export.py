"""preview.png (pointforge.implant.export): the down-sampling and the drawing, against their plain forms."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

from pointforge.data.surface import downsample_mask
from pointforge.implant import export
from tests.helpers import shell_mask


def _mean_downsample(mask: np.ndarray, max_grid: int) -> tuple[np.ndarray, int]:
    """The plain form: pad to whole blocks, a block set where the mean of its voxels is at least 0.25."""
    factor = int(np.ceil(max(mask.shape) / max_grid))
    if factor <= 1:
        return mask, 1
    m = np.pad(mask, [(0, (-s) % factor) for s in mask.shape])
    shp = [s // factor for s in m.shape]
    return m.reshape(shp[0], factor, shp[1], factor, shp[2], factor).mean(axis=(1, 3, 5)) >= 0.25, factor


@pytest.mark.parametrize("max_grid", [64, 20, 13, 9, 7])
def test_downsampling_counts_the_mask_box_as_the_mean_over_the_volume_does(max_grid):
    """Blocks counted over the box only, in integers, equal the mean over every padded block (any factor,
    grids not divisible by it, boxes at the volume's far border and at a quarter exactly)."""
    rng = np.random.default_rng(max_grid)
    shape = (61, 47, 53)
    set_blocks = 0
    for box in ((slice(5, 30), slice(9, 14), slice(0, 53)), (slice(40, 61), slice(30, 47), slice(45, 53))):
        mask = np.zeros(shape, bool)
        mask[box] = rng.random(mask[box].shape) < 0.45
        ours, factor = downsample_mask(mask, max_grid)
        plain, plain_factor = _mean_downsample(mask, max_grid)
        assert factor == plain_factor and ours.shape == plain.shape and np.array_equal(ours, plain)
        set_blocks += int(ours.sum())
        assert not ours.all()
    assert set_blocks > 0
    quarter = np.zeros((8, 8, 8), bool)
    quarter[0, 0, :2] = True  # 2 of a 2³ block: exactly a quarter, set
    quarter[4, 4, 4] = True  # 1 of 8: not set
    ours, factor = downsample_mask(quarter, 4)
    assert factor == 2 and ours[0, 0, 0] and ours.sum() == 1
    assert not downsample_mask(np.zeros((9, 9, 9), bool), 4)[0].any()


def test_the_preview_is_the_picture_savefig_draws_after_its_extra_layout_pass(tmp_path, monkeypatch):
    """render_preview drops tight_layout's placeholder engine so savefig draws the panels once; the pixels
    are those drawn with the engine kept (savefig's extra pass before the real drawing)."""
    skull = shell_mask((40, 40, 40), radii=(15, 14, 13), thickness=3.0)
    implant = skull & (np.arange(40) > 28)[None, None, :]
    agreement = implant * np.linspace(0.2, 1.0, 40, dtype=np.float32)[:, None, None]
    layers = [
        export.Layer(skull & ~implant, (0.89, 0.85, 0.76), 1.0, "skull"),
        export.Layer(implant, (0.95, 0.45, 0.1), 1.0, "implant", values=agreement),
    ]
    export.render_preview(tmp_path / "once.png", layers, spacing=(0.5, 0.5, 0.6), title="t", max_grid=16)
    monkeypatch.setattr(Figure, "set_layout_engine", lambda self, *a, **k: None)  # the engine stays: two passes
    export.render_preview(tmp_path / "twice.png", layers, spacing=(0.5, 0.5, 0.6), title="t", max_grid=16)
    once, twice = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("once", "twice"))
    assert once.shape == twice.shape and np.array_equal(once, twice)
    assert len(np.unique(once.reshape(-1, once.shape[-1]), axis=0)) > 50  # a real picture, not a blank one


def test_each_layer_is_decimated_to_the_preview_face_budget():
    skull = shell_mask((48, 48, 48), radii=(20, 19, 18), thickness=3.0)
    layers = [export.Layer(skull, (0.89, 0.85, 0.76), 1.0, "skull")]
    (full, _, _), *_ = export._layer_meshes(layers, (1.0, 1.0, 1.0), 128, 10**9)[0]
    (small, _, _), *_ = export._layer_meshes(layers, (1.0, 1.0, 1.0), 128, len(full) // 5)[0]
    assert len(small) <= len(full) // 5 < len(full)
    # Fewer faces, the same surface: its extent within a voxel of the full mesh's.
    np.testing.assert_allclose(small.reshape(-1, 3).min(0), full.reshape(-1, 3).min(0), atol=1.0)
    np.testing.assert_allclose(small.reshape(-1, 3).max(0), full.reshape(-1, 3).max(0), atol=1.0)


def test_an_implant_in_a_skulls_opening_is_seen_from_above(tmp_path):
    """Every layer's triangles are sorted by depth together: from above, the implant filling the skull's
    top opening is drawn over the skull's far side (drawn as separate collections, the skull hid it)."""
    shell = shell_mask((48, 48, 48), radii=(20, 19, 18), thickness=3.0)
    top, middle, back = (
        np.arange(48)[None, None, :] > 34,
        np.abs(np.arange(48) - 24)[:, None, None] < 10,
        np.arange(48)[None, :, None] > 26,
    )
    implant = shell & top & middle & back  # not the skull's point nearest the viewer
    layers = [
        export.Layer(shell & ~implant, (0.89, 0.85, 0.76), 1.0, "skull"),
        export.Layer(implant, (0.95, 0.45, 0.1), 1.0, "implant"),
    ]
    export.render_preview(tmp_path / "top.png", layers, views=((80, -90, "superior"),))
    rgb = np.asarray(Image.open(tmp_path / "top.png").convert("RGB")).astype(int)
    orange = (rgb[..., 0] - rgb[..., 2] > 120) & (rgb[..., 0] - rgb[..., 1] > 60)
    bone = (np.abs(rgb[..., 0] - rgb[..., 1]) < 40) & (rgb[..., 0] - rgb[..., 2] < 60) & (rgb.sum(-1) < 700)
    # About 12 % of the picture's skull and implant is implant; drawn as two collections, under 1 %.
    assert orange.sum() > 0.06 * (orange.sum() + bone.sum())

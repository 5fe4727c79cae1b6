"""preview.png (pointforge.implant.export): the down-sampling and the drawing, against their plain forms."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

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
        ours, factor = export._downsample(mask, max_grid)
        plain, plain_factor = _mean_downsample(mask, max_grid)
        assert factor == plain_factor and ours.shape == plain.shape and np.array_equal(ours, plain)
        set_blocks += int(ours.sum())
        assert not ours.all()
    assert set_blocks > 0
    quarter = np.zeros((8, 8, 8), bool)
    quarter[0, 0, :2] = True  # 2 of a 2³ block: exactly a quarter, set
    quarter[4, 4, 4] = True  # 1 of 8: not set
    ours, factor = export._downsample(quarter, 4)
    assert factor == 2 and ours[0, 0, 0] and ours.sum() == 1
    assert not export._downsample(np.zeros((9, 9, 9), bool), 4)[0].any()


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

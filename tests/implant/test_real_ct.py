"""Real CT series through `pointforge generate`, where they are on this machine (never in the repository).

``POINTFORGE_REAL_CT`` names a folder holding ``female_head/`` (the Visible
Human Female head CT, U.S. National Library of Medicine) and ``ge_tilt/`` (the
GE series of neurolabusc/dcm_qa_ct: 18.5° gantry tilt, 4 and 7 mm slices);
docs/serve.md says where to get them. The head has no defect: one is cut with
the project's own defect generator, the bone removed from the CT's pixels.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from tests.dicom_series import nearest_mm, seg_points
from tests.helpers import run_cli_process

REAL = Path(os.environ.get("POINTFORGE_REAL_CT", "/nonexistent"))
pytestmark = pytest.mark.slow


def needs(name: str):
    """Skip (before the tiny models are trained) unless the series ``name`` is on this machine."""
    reason = f"set POINTFORGE_REAL_CT to a folder holding {name}/ (docs/serve.md) to run this"
    return pytest.mark.skipif(not (REAL / name).is_dir(), reason=reason)


def defective_head(source: Path, folder: Path) -> tuple[np.ndarray, str]:
    """The head series with a random_1 defect cut (its bone set to 40 HU) into ``folder``; the defect, the FoR UID."""
    import pydicom

    from pointforge.data.dicom import read_ct_series
    from pointforge.data.synthetic.defects import make_defect

    series = read_ct_series(source)
    assert np.allclose(series.skull.spacing, 1.0) and series.skull.shape == (512, 512, 234)  # its own grid
    defect = make_defect(series.skull.data, "random_1", np.random.default_rng(0), series.skull.spacing)
    folder.mkdir()
    for k, header in enumerate(series.headers):
        ds = pydicom.dcmread(source / f"vhf.{round(float(header.ImagePositionPatient[2])) + 1:04d}.dcm")
        pixels = ds.pixel_array.copy()
        pixels[defect[:, :, k].T] = int((40 - float(ds.RescaleIntercept)) / float(ds.RescaleSlope))
        ds.PixelData = pixels.tobytes()
        ds.save_as(folder / f"slice{k:03d}.dcm")
    return defect, series.frame_of_reference_uid


@needs("female_head")
def test_the_visible_human_head_with_a_cut_defect_comes_back_as_seg_and_stl_on_its_bone(tiny_implant_models, tmp_path):
    import pydicom

    from pointforge.data.volumes import read_volume

    _, _, pcdiff, voxelizer = tiny_implant_models
    defect, frame = defective_head(REAL / "female_head", tmp_path / "ct")
    out = tmp_path / "case"
    code, stdout, stderr = run_cli_process(
        "generate", tmp_path / "ct", "--pcdiff", pcdiff, "--voxelizer", voxelizer, "--out", out, "-n", "2",
        timeout=900,
    )  # fmt: skip
    assert code == 0, stderr
    seg, points = seg_points(out / "implant_seg.dcm")
    stl = pydicom.dcmread(out / "implant_stl.dcm", stop_before_pixels=True)
    assert seg.FrameOfReferenceUID == frame == stl.FrameOfReferenceUID
    implant = read_volume(out / "implant.nrrd")
    voxels = implant.voxel_to_physical(np.argwhere(implant.data.astype(bool)))
    assert len(points) == len(voxels) > 0 and nearest_mm(points, voxels).max() < 1e-3
    skull = read_volume(out / "completed_skull.nrrd").data.astype(bool) & ~implant.data.astype(bool)
    gap = nearest_mm(voxels, implant.voxel_to_physical(np.argwhere(skull)))
    assert 0 < gap.min() <= math.sqrt(3), "the implant does not land on the bone within one voxel"
    assert defect.any()


@needs("ge_tilt")
def test_the_tilted_ge_series_with_7_mm_slices_is_refused_in_one_line(tiny_implant_models, tmp_path):
    _, _, pcdiff, voxelizer = tiny_implant_models
    code, _, stderr = run_cli_process(
        "generate", REAL / "ge_tilt", "--pcdiff", pcdiff, "--voxelizer", voxelizer, "--out", tmp_path / "c"
    )
    assert code != 0 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "up to 7 mm apart" in stderr and "reconstruct thin slices" in stderr

"""The serve tests' shared pieces: the session's tiny trained models and a small defective skull."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tiny_implant_models) -> tuple[Path, Path, Path]:
    """(pcdiff checkpoint, voxelizer checkpoint, a defective skull of the test split at half resolution).

    Half resolution (32³, 2× the spacing) keeps a served case to a few seconds on a busy
    2-core machine; the pipeline works in millimetres, so the models see the same skull."""
    from dataclasses import replace

    from pointforge.data.skulls.prepared import PreparedDataset
    from pointforge.data.volumes import read_volume, write_volume

    root, _, pcdiff, voxelizer = tiny_implant_models
    data = PreparedDataset(root)
    case = data.split("test")[0]
    full = read_volume(data.meta(case.defective)["source"])
    half = replace(full, data=full.data[::2, ::2, ::2], spacing=tuple(2 * s for s in full.spacing))
    return pcdiff, voxelizer, write_volume(root.parent / "skull-half.nrrd", half)

"""The serve tests' shared pieces: tiny trained models (once per session) and a small defective skull."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torch_threads, train_tiny_implant_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(pcdiff checkpoint, voxelizer checkpoint, a defective skull of the test split)."""
    from pointforge.data.skulls.prepared import PreparedDataset

    with torch_threads(1):
        root, _, pcdiff, voxelizer = train_tiny_implant_models(tmp_path_factory.mktemp("serve-models"))
    data = PreparedDataset(root)
    case = data.split("test")[0]
    return pcdiff, voxelizer, Path(data.meta(case.defective)["source"])

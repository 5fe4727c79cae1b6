from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import register_test_tasks, torch_threads, train_tiny_implant_models

# Tests are sized for 2 cores; more threads only add contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# The fault-injecting task (tests/faulty_toy.py) for runs in this process;
# child processes find it through tests.helpers.subprocess_env.
register_test_tasks()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    The networks and tensors in these tests are small: on a shared 2-core machine a
    second thread only adds synchronisation stalls (measured 5-10x slower), never speed.
    """
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def synthetic_skulls(tmp_path_factory) -> Path:
    """PCDiff tiny's synthetic data (4 skulls of 64³, 4096 points, split 0.5/0.25/0.25), prepared once per session.

    Shared by the PCDiff tests and :func:`tiny_implant_models` (building it takes seconds)."""
    from pointforge.tasks.pcdiff.config import SyntheticSection
    from pointforge.tasks.pcdiff.task import ensure_prepared_dataset

    return ensure_prepared_dataset(tmp_path_factory.getbasetemp() / "pcdiff-synthetic", SyntheticSection())


@pytest.fixture(scope="session")
def tiny_implant_models(tmp_path_factory, synthetic_skulls):
    """Tiny PCDiff and voxelizer, trained once per session for every test that runs the implant pipeline.

    (prepared root, raw root, pcdiff checkpoint, voxelizer checkpoint); see
    :func:`tests.helpers.train_tiny_implant_models`."""
    with torch_threads(1):
        return train_tiny_implant_models(tmp_path_factory.mktemp("implant-models"), synthetic_skulls)

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import register_test_tasks, torch_threads, train_tiny_implant_models

# Tests are sized for 2 cores; more threads only add contention. Under pytest-xdist
# (`make test`: two workers) each worker is one of the two.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if XDIST_WORKER else min(2, os.cpu_count() or 1))

# The fault-injecting task (tests/faulty_toy.py) for runs in this process;
# child processes find it through tests.helpers.subprocess_env.
register_test_tasks()


SHARED_SESSION_FIXTURES = {"tiny_implant_models"}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup``: a test module runs on one worker (its module fixtures, a
    Slurm cluster or a reference run, are made once), and so does every test that uses a session fixture
    of :data:`SHARED_SESSION_FIXTURES` (the tiny implant models are trained once, not once per worker)."""
    if not XDIST_WORKER:
        return
    for item in items:
        shared = SHARED_SESSION_FIXTURES & set(item.fixturenames)
        group = "shared-session-fixtures" if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


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

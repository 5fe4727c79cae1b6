from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import register_test_tasks, torch_threads, train_tiny_implant_models

# Tests are sized for 2 cores; more threads only add contention. Under pytest-xdist
# (`make test`: two workers, `--dist loadfile`) each worker is one of the two.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if XDIST_WORKER else min(2, os.cpu_count() or 1))

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


def session_shared_dir(tmp_path_factory) -> Path:
    """A folder every process of this test run shares: the run's base temporary folder, or under pytest-xdist
    the folder that holds every worker's own (``pytest-N/``, above ``pytest-N/popen-gwK/``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if XDIST_WORKER else base


@pytest.fixture(scope="session")
def synthetic_skulls(tmp_path_factory) -> Path:
    """PCDiff tiny's synthetic data (4 skulls of 64³, 4096 points, split 0.5/0.25/0.25), prepared once per test run.

    Shared by the PCDiff tests and :func:`tiny_implant_models` (building it takes seconds); under pytest-xdist
    the workers share one copy (``ensure_prepared_dataset`` builds it once when several processes ask)."""
    from pointforge.data.cache import SyntheticSection
    from pointforge.tasks.pcdiff.dataset import ensure_prepared_dataset

    return ensure_prepared_dataset(session_shared_dir(tmp_path_factory) / "pcdiff-synthetic", SyntheticSection())


@pytest.fixture(scope="session")
def tiny_implant_models(tmp_path_factory, synthetic_skulls):
    """Tiny PCDiff and voxelizer, trained once per test run for every test that runs the implant pipeline.

    (prepared root, raw root, pcdiff checkpoint, voxelizer checkpoint); see
    :func:`tests.helpers.train_tiny_implant_models`. Under pytest-xdist the first worker to ask trains them
    while holding a lock; the other waits and loads the same checkpoints (training them takes about a minute)."""
    from pointforge.flock import exclusive_lock

    shared = session_shared_dir(tmp_path_factory)
    base, done = shared / "implant-models", shared / "implant-models.json"
    with exclusive_lock(shared / "implant-models.lock"):
        if not done.is_file():
            shutil.rmtree(base, ignore_errors=True)  # a worker that failed half-way left it
            base.mkdir()
            with torch_threads(1):
                trained = train_tiny_implant_models(base, synthetic_skulls)
            done.write_text(json.dumps([str(p) for p in trained]))
    return tuple(Path(p) for p in json.loads(done.read_text()))

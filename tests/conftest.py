from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"

# Tests are sized for 2 cores; more threads only add contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` torch threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    The networks and tensors in these tests are small: on a shared 2-core machine a
    second thread only adds synchronisation stalls (measured 5-10x slower), never speed.
    """
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"reference fixtures folder {FIXTURES} is absent")
    return FIXTURES


def shell_mask(shape=(40, 40, 40), center=None, radii=(15, 13, 12), thickness=3.0, open_below: float | None = None):
    """A closed (or bottom-open) ellipsoidal shell, a stand-in skull for I/O tests."""
    center = np.asarray(center if center is not None else [s / 2 for s in shape], dtype=float)
    g = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), axis=-1).astype(float)
    r = np.sqrt((((g - center) / np.asarray(radii)) ** 2).sum(-1))
    outer = r <= 1.0
    inner = r <= 1.0 - thickness / min(radii)
    mask = outer & ~inner
    if open_below is not None:
        mask[..., : int(open_below)] = False
    return mask


def write_raw_dataset(root: Path, layout: str = "skullbreak", n_skulls: int = 3, shape=(40, 40, 40),
                      spacing=(1.0, 1.0, 1.0), fmt: str = ".nrrd", foreground: int = 1, defects=("bilateral", "random_1")):
    """A minimal raw dataset in a standard layout, with box-shaped defects cut from shells."""
    from pointforge.data.volumes import write_volume

    rng = np.random.default_rng(0)
    for k in range(n_skulls):
        complete = shell_mask(shape, radii=(15 + k % 2, 13, 12 - k % 2))
        stem = f"{k:03d}"
        cut = np.zeros(shape, bool)
        x0 = int(rng.integers(4, 10))
        cut[x0 : x0 + 12, 10:30, 14:30] = True
        implant = complete & cut
        defective = complete & ~cut
        as_type = lambda m: (m.astype(np.uint8) * foreground)
        write_volume(root / "complete_skull" / f"{stem}{fmt}", as_type(complete), spacing=spacing)
        if layout == "skullbreak":
            for d in defects:
                write_volume(root / "defective_skull" / d / f"{stem}{fmt}", as_type(defective), spacing=spacing)
                write_volume(root / "implant" / d / f"{stem}{fmt}", as_type(implant), spacing=spacing)
        else:
            write_volume(root / "defective_skull" / f"{stem}{fmt}", as_type(defective), spacing=spacing)
            write_volume(root / "implant" / f"{stem}{fmt}", as_type(implant), spacing=spacing)
    return root


def subprocess_env() -> dict[str, str]:
    """The environment for a child process (torchrun, a launched job) that imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc), so a test can kill a whole job tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

"""What the tests share: paths, a quiet config, one CLI runner, child processes, the tests' own task.

Import it as ``from tests.helpers import ...`` (``tests`` is a package; pytest
puts the repository root on ``sys.path``, and :func:`subprocess_env` puts it on
every child's ``PYTHONPATH``). Fixtures stay in ``conftest.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "pointforge" / "configs"
TOY_TINY = CONFIGS / "toy" / "tiny.yaml"
# Outputs of the upstream implementations on fixed inputs (tests/fixtures/README.md).
FIXTURES = REPO / "tests" / "fixtures"

# Overrides that keep a test run quiet and small: no progress bar, no
# TensorBoard files, one torch thread (the test machines have 2 cores).
QUIET = ["log.progress=off", "log.tensorboard=false", "perf.threads=1"]


def quiet_config(task: str, config: str | os.PathLike, *overrides: str):
    """The resolved training config of ``config`` for ``task`` with :data:`QUIET` and ``overrides``."""
    from pointforge.tasks.configs import load_train_config

    return load_train_config(task, config, [*QUIET, *overrides])


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` torch threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the command line


def run_cli(*args):
    """``pointforge ARGS...`` in this process; returns typer's ``Result`` (exit_code, output, exception)."""
    from typer.testing import CliRunner

    from pointforge.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def run_cli_process(*args, cwd=None, timeout: float = 300) -> tuple[int, str, str]:
    """``python -m pointforge ARGS...`` as a real child process: (exit code, stdout, stderr), kept apart.

    For what only a process shows: the exit status a shell sees, what goes to
    stderr rather than stdout, and the interpreter's own start-up.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "pointforge", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=subprocess_env(),
    )
    return proc.returncode, proc.stdout, proc.stderr


# --------------------------------------------------------------------------- data on disk


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


def write_raw_dataset(
    root: Path,
    layout: str = "skullbreak",
    n_skulls: int = 3,
    shape=(40, 40, 40),
    spacing=(1.0, 1.0, 1.0),
    fmt: str = ".nrrd",
    foreground: int = 1,
    defects=("bilateral", "random_1"),
):
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

        def as_type(m):
            return m.astype(np.uint8) * foreground

        write_volume(root / "complete_skull" / f"{stem}{fmt}", as_type(complete), spacing=spacing)
        if layout == "skullbreak":
            for d in defects:
                write_volume(root / "defective_skull" / d / f"{stem}{fmt}", as_type(defective), spacing=spacing)
                write_volume(root / "implant" / d / f"{stem}{fmt}", as_type(implant), spacing=spacing)
        else:
            write_volume(root / "defective_skull" / f"{stem}{fmt}", as_type(defective), spacing=spacing)
            write_volume(root / "implant" / f"{stem}{fmt}", as_type(implant), spacing=spacing)
    return root


def physical_skull(
    spacing=(1.0, 1.0, 1.0),
    *,
    extent_mm: float = 72.0,
    direction=None,
    radii_mm=(30.0, 26.0, 24.0),
    thickness_mm: float = 4.0,
    cut_mm=((12.0, 40.0), (-12.0, 12.0), (-10.0, 14.0)),
):
    """A defective ellipsoidal shell and its implant (a box cut out of it), defined in millimetres and sampled
    on a grid of ``spacing`` and ``direction``, centred on physical (0, 0, 0): ``(defective, implant)`` Volumes.

    The same physical skull on any grid, for checks that a result does not depend on the grid.
    """
    from pointforge.data.volumes import Volume

    spacing = np.asarray(spacing, dtype=np.float64)
    direction = np.eye(3) if direction is None else np.asarray(direction, dtype=np.float64)
    shape = np.floor(extent_mm / spacing).astype(int) + 1
    origin = -direction @ (spacing * (shape - 1) / 2)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1).reshape(-1, 3)
    xyz = (ijk * spacing) @ direction.T + origin
    r = np.sqrt(((xyz / np.asarray(radii_mm)) ** 2).sum(-1))
    shell = (r <= 1.0) & (r > 1.0 - thickness_mm / min(radii_mm))
    cut = np.all([(xyz[:, a] >= lo) & (xyz[:, a] <= hi) for a, (lo, hi) in enumerate(cut_mm)], axis=0)
    grid = tuple(int(n) for n in shape)

    def volume(mask):
        return Volume(data=mask.reshape(grid), spacing=tuple(spacing), origin=tuple(origin), direction=direction.copy())

    return volume(shell & ~cut), volume(shell & cut)


# --------------------------------------------------------------------------- tiny trained implant models


def tiny_implant_pcdiff_config(base: Path, root: Path):
    """The PCDiff run of :func:`train_tiny_implant_models`: tiny, 150 steps on a short schedule (T = 20), in ``base``/pcdiff."""
    return quiet_config(
        "pcdiff",
        CONFIGS / "pcdiff" / "tiny.yaml",
        *TINY_MODELS_QUIET,
        f"run.dir={base / 'pcdiff'}",
        f"task.data_root={root}",
        "task.diffusion.timesteps=20",
        "task.diffusion.beta_start=5e-3",
        "task.diffusion.beta_end=0.25",
        "train.max_steps=150",
        "train.ema_decay=null",
        "optim.lr=3e-3",
    )


TINY_MODELS_QUIET = ["ckpt.every_minutes=0", "train.epochs=1000", "train.eval_every=0", "task.synthetic=null"]


def train_tiny_implant_models(base: Path, root: Path) -> tuple[Path, Path, Path, Path]:
    """Tiny PCDiff and voxelizer trained through the engine under ``base`` on the prepared ``root`` (about half a minute).

    PCDiff runs a short schedule (T = 20) so that its samples land on the skull
    after a few hundred steps (:func:`tiny_implant_pcdiff_config`). Returns (prepared root, raw root, pcdiff
    checkpoint, voxelizer checkpoint). Far from good models: tests with them
    check what the code does with whatever they propose, not implant quality.
    """
    from pointforge.tasks import get_task
    from pointforge.train.engine import train

    vox = quiet_config(
        "voxelizer",
        CONFIGS / "voxelizer" / "tiny.yaml",
        *TINY_MODELS_QUIET,
        f"run.dir={base / 'voxelizer'}",
        f"task.data_root={root}",
        "train.max_steps=30",
        "task.n_points=1024",
    )
    pc_ckpt = train(get_task("pcdiff"), tiny_implant_pcdiff_config(base, root), console=False).checkpoint
    vox_ckpt = train(get_task("voxelizer"), vox, console=False).checkpoint
    return root, root / "raw", Path(pc_ckpt), Path(vox_ckpt)


# --------------------------------------------------------------------------- the tests' own tasks

# Tasks that exist for the tests only, by name: "module:Class", as an entry point names them.
TEST_TASKS = {"faulty_toy": "tests.faulty_toy:FaultyToyTask"}
_plugin_dir: Path | None = None


def register_test_tasks() -> None:
    """Make the tests' tasks (:data:`TEST_TASKS`) known to ``get_task`` in this process."""
    import importlib

    from pointforge.tasks import register_task

    for name, target in TEST_TASKS.items():
        module, _, attr = target.partition(":")
        register_task(getattr(importlib.import_module(module), attr), name)


def task_plugin_dir() -> Path:
    """A folder that, on ``sys.path``, declares :data:`TEST_TASKS` in the ``pointforge.tasks`` entry-point group.

    It holds only the metadata of an installed distribution, which is what
    ``importlib.metadata`` reads: a child process (torchrun's workers, a
    launched job) with this folder and the repository root on its
    ``PYTHONPATH`` finds the tests' tasks as it would find a third-party task
    package, and no pointforge module needs to know about the tests. Written
    once per test session in a temporary folder, removed at exit.
    """
    global _plugin_dir
    if _plugin_dir is None:
        root = Path(tempfile.mkdtemp(prefix="pointforge-test-tasks-"))
        atexit.register(shutil.rmtree, root, True)
        info = root / "pointforge_test_tasks-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pointforge-test-tasks\nVersion: 0\n")
        lines = "".join(f"{name} = {target}\n" for name, target in TEST_TASKS.items())
        (info / "entry_points.txt").write_text(f"[pointforge.tasks]\n{lines}")
        _plugin_dir = root
    return _plugin_dir


# --------------------------------------------------------------------------- child processes


def subprocess_env() -> dict[str, str]:
    """The environment for a child process (torchrun, a launched job) that imports this checkout and the tests' tasks."""
    env = dict(os.environ)
    path = [str(REPO), str(task_plugin_dir()), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(path)
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


def torchrun_command(task: str, config: str | os.PathLike, overrides, *, nproc: int = 2) -> list[str]:
    """``torchrun --standalone`` running ``pointforge train TASK`` on ``nproc`` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "pointforge",
        "train",
        task,
        "--config",
        str(config),
        *overrides,
    ]


class Job:
    """A process tree in its own session, output to ``log_dir/NAME.out``; ``stop()`` kills whatever is left."""

    def __init__(self, cmd: list[str], log_dir: Path, name: str):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = log_dir / f"{name}.out"
        self._out = open(self.out_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=subprocess_env(),
            cwd=str(log_dir),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"job did not end within {timeout} s; output:\n{self.output()[-3000:]}")

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.out_path.read_text(errors="replace")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        # torchrun starts each worker in a session of its own, so killing our
        # process group is not enough: kill every descendant by pid (only while
        # the root is unreaped, so no pid can have been reused).
        if self.proc.poll() is None:
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=30)
        if not self._out.closed:
            self._out.close()


def run_to_end(job: Job, timeout: float = 90) -> str:
    """Wait for ``job``, assert it exited 0, return its output; the tree is killed either way."""
    try:
        code = job.wait(timeout)
        out = job.output()
        assert code == 0, out[-4000:]
        return out
    finally:
        job.stop()

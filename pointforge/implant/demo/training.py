"""The demo's training: PCDiff and the voxelizer side by side, in timed phases, each phase's checkpoints kept.

Each network trains as a torchrun job of one process, started by the one
torchrun launcher (:func:`pointforge.train.torchrun.start_torchrun`), the way
``pointforge train --nproc`` starts its workers; a phase resumes the last.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from pointforge.atomic import atomic_path, atomic_write_text
from pointforge.errors import DataError
from pointforge.implant.demo.settings import DemoSettings
from pointforge.tasks.configs import resolve_config_path
from pointforge.train.records import read_run_status
from pointforge.train.torchrun import start_torchrun, worker_args

# The two networks the demo trains, each from its packaged preset of the same name (``demo`` by default).
DEMO_TASKS = ("pcdiff", "voxelizer")


def demo_config(task: str, name: str = "demo") -> Path:
    """The demo's training config for ``task``: the packaged ``pointforge/configs/<task>/<name>.yaml``."""
    return resolve_config_path(task, name)


def phase_name(minutes: float, steps: dict, by_steps: bool) -> str:
    """How a kept phase's models are named: by their step counts when the budget was steps
    (``--train-steps``), else by the training minutes they had."""
    if by_steps:
        return f"{steps.get('pcdiff'):,} PCDiff and {steps.get('voxelizer'):,} voxelizer steps"
    return f"{minutes:g} min"


def decays(config: Path) -> bool:
    """Whether ``config``'s LR schedule decays (cosine or linear): the demo then spreads it over the whole budget."""
    sched = (yaml.safe_load(config.read_text()) or {}).get("sched") or {}
    return sched.get("name") in ("cosine", "linear")


def phase_worker(
    task: str,
    config: Path,
    run_dir: Path,
    data_root: Path,
    minutes: float,
    device: str,
    horizon: float | None,
    *,
    until_step: int | None = None,
) -> list[str]:
    """The ``train`` arguments of one network for one phase, resumed from the last: ``minutes`` more of
    training, or with ``until_step`` training up to that global step whatever the time it takes."""
    # A decaying schedule runs over the whole budget (all phases), in minutes of
    # training, so that the LR reaches its floor as the last phase ends.
    decay = [f"sched.horizon_minutes={horizon:g}"] if horizon is not None else []
    budget = (
        [f"train.max_minutes={minutes:.4f}", "train.max_steps=null"]
        if until_step is None
        else ["train.max_minutes=null", f"train.max_steps={until_step}"]
    )
    overrides = [
        f"run.dir={run_dir}",
        f"task.data_root={data_root}",
        *budget,
        "train.epochs=100000",
        f"run.device={device}",
        "log.progress=off",
        *decay,
    ]
    return worker_args(task, config=config, overrides=overrides, resume="auto")


def phase_steps(total: int, fraction: float) -> int:
    """The global step a phase ending at ``fraction`` of a ``total``-step budget trains to (at least 1)."""
    return max(1, round(fraction * total))


def _status(run_dir: Path) -> dict[str, Any]:
    return read_run_status(run_dir) or {}


def train_side_by_side(
    jobs: dict[str, list[str]],
    run_dirs: dict[str, Path],
    minutes: float,
    *,
    progress=None,
    until: dict[str, int] | None = None,
) -> dict[str, dict]:
    """Run each job (``train`` arguments) as a torchrun job of one process, all at once; wait for all.

    ``progress(seconds, budget seconds, {name: {"step", "until"}})`` every second: each job's global
    step and, for a step budget (``until``: the step each job trains to), its target, else None.
    A failed job is one clear error naming its log
    (``RUNS/<name>.log``). Interrupted, the jobs are asked to stop: each
    worker finishes its step and writes a checkpoint.
    """
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, worker in jobs.items():
            run_dirs[name].parent.mkdir(parents=True, exist_ok=True)
            procs[name] = start_torchrun(worker, nproc=1, log=_log(run_dirs[name], name))
        t0 = time.monotonic()
        while any(p.poll() is None for p in procs.values()):
            if progress:  # the budget counts from each process's first step: keep the bar short of full until they end
                progress(
                    min(time.monotonic() - t0, minutes * 60 * 0.99),
                    minutes * 60,
                    {n: _steps(_status(run_dirs[n]), (until or {}).get(n)) for n in procs},
                )
            time.sleep(1.0)
    except BaseException:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()  # torchrun passes SIGTERM on to its worker, which saves and stops
        raise
    failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if failed:
        name = next(iter(failed))
        log = _log(run_dirs[name], name)
        raise DataError(f"training {name} failed (exit {failed[name]}): {_last_words(log)}; full log: {log}")
    final = {n: _status(run_dirs[n]) for n in procs}
    if progress:
        progress(minutes * 60, minutes * 60, {n: _steps(final[n], (until or {}).get(n)) for n in procs})
    return final


def _steps(status: dict[str, Any], until: int | None) -> dict[str, int | None]:
    return {"step": status.get("global_step"), "until": until}


def _log(run_dir: Path, name: str) -> Path:
    return run_dir.parent / f"{name}.log"


def _last_words(log: Path) -> str:
    """Why a job failed, from its log: the worker's last ``error:`` line, else the log's last three lines."""
    lines = log.read_text(errors="replace").strip().splitlines()
    # torchrun ends a failed job with its own summary, which names no cause.
    said = [line for line in lines if line.startswith("error: ")]
    return said[-1] if said else " | ".join(lines[-3:])


PHASES_FILE = "phases.json"  # the phases trained so far (their kept checkpoints), written after each


def _kept_phases(out: Path, resume: bool) -> list[dict]:
    """The phases an earlier run in ``out`` finished (``resume``), else none."""
    path = out / PHASES_FILE
    if not (resume and path.is_file()):
        return []
    try:
        kept = json.loads(path.read_text())
    except ValueError:
        raise DataError(f"{path} is unreadable; delete it to train every phase again") from None
    missing = [
        c["checkpoint"] for k in kept for c in (k["pcdiff"], k["voxelizer"]) if not Path(c["checkpoint"]).is_file()
    ]
    if missing:
        raise DataError(f"{missing[0]} (a trained phase's model) is gone; delete {path} to train every phase again")
    return kept


def train_phases(
    out: Path, s: DemoSettings, prepared: Path, log: Callable[[str], None], progress, *, resume: bool = False
) -> list[dict]:
    """Stage 2: both models trained side by side in phases; each phase's checkpoints kept (the learning curve).

    With ``resume``, the phases ``phases.json`` lists as trained are kept as they are, and the next one
    resumes from its runs' last checkpoints: exactly to its steps under a step budget; under a time
    budget it trains its share of the minutes again from there (each launch's clock starts at zero)."""
    run_dirs = {task: out / "runs" / task for task in DEMO_TASKS}
    configs = {task: demo_config(task, s.config) for task in DEMO_TASKS}
    kept = _kept_phases(out, resume)
    done_fraction = 0.0
    for k, fraction in enumerate(s.phases):
        if k < len(kept):
            log(f"[2/7] phase {k + 1}/{len(s.phases)} was trained by the run being resumed: kept")
            done_fraction = fraction
            continue
        minutes = (fraction - done_fraction) * s.minutes
        budget = (
            f"{minutes:.2f} min (to {fraction * s.minutes:.2f} of {s.minutes:g} min)"
            if s.train_steps is None
            else "to steps " + " and ".join(str(phase_steps(t, fraction)) for t in s.train_steps)
        )
        log(f"[2/7] training PCDiff and the voxelizer side by side: phase {k + 1}/{len(s.phases)}, {budget}")
        jobs = {
            n: phase_worker(
                n,
                configs[n],
                run_dirs[n],
                prepared,
                minutes,
                s.device,
                s.minutes if decays(configs[n]) and s.train_steps is None else None,
                until_step=None if s.train_steps is None else phase_steps(s.train_steps[i], fraction),
            )
            for i, n in enumerate(run_dirs)
        }
        until = (
            None if s.train_steps is None else {n: phase_steps(t, fraction) for n, t in zip(run_dirs, s.train_steps)}
        )
        status = train_side_by_side(
            jobs,
            run_dirs,
            minutes,
            progress=(lambda d, n, info: progress("train", d, n, info)) if progress else None,
            until=until,
        )
        snapshot: dict[str, Any] = {"minutes": round(fraction * s.minutes, 3)}
        for name in run_dirs:
            src = Path(status[name].get("last_checkpoint") or run_dirs[name] / "checkpoints" / "latest.pt")
            dst = out / "checkpoints" / f"{name}-{fraction * s.minutes:.2f}min.pt"
            dst.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(dst, suffix=".pt") as tmp:
                shutil.copyfile(src, tmp)
            snapshot[name] = {
                "checkpoint": str(dst),
                "step": status[name].get("global_step"),
                "metrics": status[name].get("metrics", {}),
            }
        kept.append(snapshot)
        atomic_write_text(out / PHASES_FILE, json.dumps(kept, indent=1))
        done_fraction = fraction
    return kept

"""``pointforge train`` and ``pointforge ckpt``: parse, call the engine, print.

Register with the root app::

    from pointforge.cli import train as train_cli
    train_cli.register(app)

Under torchrun each rank runs ``python -m pointforge train ...`` (what
``--nproc`` and ``pointforge launch`` start), or ``torchrun --no-python
pointforge train ...``. Both end through :func:`pointforge.cli.entry.run`,
the one error-handling path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from pointforge.cli.entry import hard_exit
from pointforge.errors import ConfigError
from pointforge.formats import format_bytes

ckpt_app = typer.Typer(help="Inspect and convert checkpoints.", no_args_is_help=True, add_completion=False)


def train_command(
    task: str = typer.Argument(..., help="Task name: toy, pcdiff, pcdiff_student, voxelizer, upsampler, unet."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="key=value overrides, e.g. optim.lr=1e-4 data.global_batch=16."
    ),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="A preset name (tiny, small, demo, paper) or a YAML file."
    ),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="'auto' (newest good checkpoint in the run dir) or a checkpoint path."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the resolved plan (batch split, LR, steps, run dir) and exit."
    ),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="Start torchrun with this many processes on this node."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        min=0,
        help="With --nproc: restarts after a crash (each resumes from the latest checkpoint).",
    ),
    wandb: bool = typer.Option(
        False, "--wandb", help="Also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)."
    ),
) -> None:
    """Train TASK on one device, or data-parallel under torchrun / --nproc."""
    from pointforge.tasks import get_task
    from pointforge.tasks.configs import load_train_config
    from pointforge.train.dist import DistributedFailure
    from pointforge.train.engine import train
    from pointforge.train.run_plan import dry_run_plan
    from pointforge.train.step import TrainingDiverged

    overrides = list(overrides or [])
    cfg = load_train_config(task, config, overrides)
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if nproc is not None and under_torchrun:
        raise ConfigError("--nproc starts torchrun itself; under torchrun leave it out")
    if max_restarts and nproc is None:
        raise ConfigError("--max-restarts needs --nproc (or pass --max-restarts to torchrun yourself)")
    if dry_run:
        plan = dry_run_plan(get_task(task), cfg, world_size=nproc)
        if int(os.environ.get("RANK", "0")) == 0:
            typer.echo(plan.text())
        return
    if nproc is not None:
        from pointforge.train.records import read_run_status
        from pointforge.train.torchrun import run_torchrun, worker_args

        # Check the batch split before starting processes: config errors
        # should cost a second, not a torchrun start-up.
        dry_run_plan(get_task(task), cfg, world_size=nproc)
        worker = worker_args(task, config=config, overrides=overrides, resume=resume, wandb=wandb)
        code = run_torchrun(worker, nproc=nproc, max_restarts=max_restarts, run_dir=cfg.run.dir)
        status = read_run_status(cfg.run.dir) or {}
        if code == 0 and status.get("status") == "stopped":
            typer.echo(
                f"stopped at step {status.get('global_step')}; checkpoint {status.get('last_checkpoint')}; continue with --resume auto"
            )
        # sys.exit, not typer.Exit: a non-standalone Typer app returns an Exit's
        # code instead of raising it, and the status would be lost.
        sys.exit(code)
    try:
        result = train(get_task(task), cfg, resume=resume, wandb=wandb)
    except (TrainingDiverged, DistributedFailure) as err:
        typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        if under_torchrun:
            hard_exit(1)
        sys.exit(1)
    if result.status == "stopped" and int(os.environ.get("RANK", "0")) == 0:
        typer.echo(
            f"stopped by {result.signal or 'a signal'} at epoch {result.epoch}, step {result.global_step}; "
            f"checkpoint {result.checkpoint}; continue with --resume auto"
        )


@ckpt_app.command("inspect")
def ckpt_inspect(
    path: Path = typer.Argument(..., help="A checkpoint file, or a run dir (lists its checkpoints)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    trust: bool = typer.Option(
        False, "--trust", help="Allow files that need code to unpickle (only for files you trust)."
    ),
) -> None:
    """Show what a checkpoint holds: task, progress, config, parameters, saved devices and dtypes,
    key prefixes, size, and whether it is complete and resumable."""
    from pointforge.ops.checkpoint_surgery import inspect_checkpoint
    from pointforge.train.checkpoint.format import resume_candidates

    if path.is_dir():
        files = resume_candidates(path)
        if not files:
            raise ConfigError(f"{path} holds no checkpoints (looked in {path / 'checkpoints'})")
        for file in files:
            typer.echo(f"{file}  ({format_bytes(file.stat().st_size)})")
        return
    info = inspect_checkpoint(path, trust=trust)
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        for key, value in info.items():
            if key == "size_bytes":
                key, value = "size", format_bytes(value)
            elif isinstance(value, dict):
                value = (
                    ", ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()) or "-"
                )
            elif isinstance(value, bool):
                value = "yes" if value else "no"
            elif isinstance(value, list):
                value = ", ".join(map(str, value)) or "-"
            typer.echo(f"{key:20s} {value}")
    if not info["complete"]:
        sys.exit(1)


@ckpt_app.command("remap")
def ckpt_remap(
    source: Path = typer.Argument(
        ..., help="Checkpoint to read (ours, DDP-saved, tagged cuda:N, or a bare/upstream state dict)."
    ),
    target: Optional[Path] = typer.Argument(None, help="Where to write (same as --out)."),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Where to write (default: SOURCE's name + .remapped.pt, beside it)."
    ),
    strip_prefix: Optional[List[str]] = typer.Option(
        None, "--strip-prefix", help="Extra key prefix to remove, e.g. model. (repeatable)."
    ),
    weights: bool = typer.Option(
        False, "--weights", help="Write only the model weights (a plain state dict), not a resumable checkpoint."
    ),
    use_ema: bool = typer.Option(False, "--ema", help="Write the EMA weights (implies --weights)."),
    trust: bool = typer.Option(
        False, "--trust", help="Allow files that need code to unpickle (only for files you trust)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Write a device-agnostic copy: every tensor on the CPU, module./_orig_mod. prefixes removed.

    A pointforge checkpoint stays resumable (optimizer, schedule and progress
    kept); other files become a plain state dict. Atomic; SOURCE is untouched.
    """
    from pointforge.ops.checkpoint_surgery import remap_checkpoint

    if target is not None and out is not None and target != out:
        raise ConfigError(f"two outputs given ({target} and --out {out}); give one")
    result = remap_checkpoint(
        source,
        out or target,
        strip_prefix=tuple(strip_prefix or ()),
        weights_only_output=weights,
        use_ema=use_ema,
        trust=trust,
        force=force,
    )
    devices = ", ".join(f"{d} ×{n}" for d, n in result.saved_devices.items()) or "none"
    what = "a resumable checkpoint" if result.kind == "checkpoint" else "a plain state dict"
    typer.echo(f"wrote {result.target}: {what}, {result.tensors} tensors on the CPU (saved on: {devices})")


@ckpt_app.command("import-pcdiff", context_settings={"allow_interspersed_args": True})
def ckpt_import_pcdiff(
    source: Path = typer.Argument(
        ..., help="Upstream PCDiff checkpoint ({epoch, model_state, optimizer_state}; DDP-saved too)."
    ),
    target: Path = typer.Argument(..., help="Where to write the pointforge checkpoint (.pt)."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="key=value overrides of the training config stored with it."
    ),
    preset: Optional[str] = typer.Option(
        None,
        "--preset",
        help="PVCNN2 preset the weights are for (paper, small, tiny); default: found from the weights.",
    ),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        "-c",
        help="PCDiff training config to store with it: a preset name (e.g. paper) or a YAML file.",
    ),
    force: bool = typer.Option(False, "--force", help="Replace TARGET if it exists."),
    trust: bool = typer.Option(
        False, "--trust", help="Allow files that need code to unpickle (only for files you trust)."
    ),
) -> None:
    """Convert an upstream PCDiff checkpoint into a pointforge pcdiff checkpoint (for --resume and load_pcdiff)."""
    from pointforge.ops.pcdiff_import import import_pcdiff_checkpoint

    result = import_pcdiff_checkpoint(
        source,
        target,
        preset=preset,
        config=config,
        overrides=list(overrides or []),
        overwrite=force,
        trust=trust,
    )
    epoch = "unknown" if result.upstream_epoch is None else str(result.upstream_epoch)
    typer.echo(
        f"wrote {result.path}: PVCNN2 '{result.preset}' ({result.parameters:,} parameters, {result.tensors} tensors, "
        f"prefix '{result.prefix}' stripped), upstream epoch {epoch} → resumes at epoch {result.epochs_done}; "
        "optimizer state dropped (a resumed run starts Adam afresh)"
    )


def register(app: typer.Typer) -> None:
    """Add ``train`` and the ``ckpt`` group to the root ``pointforge`` app."""
    app.command("train", context_settings={"allow_interspersed_args": True})(train_command)
    app.add_typer(ckpt_app, name="ckpt")

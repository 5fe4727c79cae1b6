"""The `pointforge` command: a thin skin over importable functions.

Each command group lives in its own module and registers itself here. Groups
appear only when they do something real.
"""

from __future__ import annotations

import sys

import typer

from pointforge import __version__
from pointforge.cli import (
    data as data_cli,
    doctor as _doctor_cli,
    launch as _launch_cli,
    monitor as _monitor_cli,
    serve as serve_cli,
    slurm as _slurm_cli,
    train as _train_cli,
)
from pointforge.cli.demo import demo as demo_command
from pointforge.cli.entry import run
from pointforge.cli.evaluate import evaluate as evaluate_command
from pointforge.cli.evaluate_upsampling import evaluate_upsampling as evaluate_upsampling_command
from pointforge.cli.generate import generate as generate_command
from pointforge.cli.upsample import upsample as upsample_command
from pointforge.cli.view import view as view_command

app = typer.Typer(
    name="pointforge",
    help="Train point-cloud networks from one CPU to many GPUs; design cranial implants.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pointforge {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """pointforge command line."""


app.add_typer(data_cli.app, name="data")
app.command("demo")(demo_command)
app.command("generate")(generate_command)
app.command("evaluate")(evaluate_command)
app.command("view")(view_command)
app.add_typer(serve_cli.app, name="serve")
_train_cli.register(app)
_launch_cli.register(app)
_monitor_cli.register(app)
_slurm_cli.register(app)
_doctor_cli.register(app)
app.command("upsample")(upsample_command)
app.command("evaluate-upsampling")(evaluate_upsampling_command)


def main() -> None:
    """Entry point: usage errors are click's (exit 2); user errors become one clear line (exit 2).

    The same path (:func:`pointforge.cli.entry.run`) ends every torchrun worker.
    """
    sys.exit(run(app))

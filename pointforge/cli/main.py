"""The `pointforge` command: a thin skin over importable functions.

Each command group lives in its own module and registers itself here. Groups
appear only when they do something real.
"""

from __future__ import annotations

import sys

import typer

from pointforge import __version__
from pointforge.cli import data as data_cli
from pointforge.cli.demo import demo as demo_command
from pointforge.cli.evaluate import evaluate as evaluate_command
from pointforge.errors import UserError

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
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """pointforge command line."""


app.add_typer(data_cli.app, name="data")
app.command("demo")(demo_command)
app.command("evaluate")(evaluate_command)




def main() -> None:
    """Entry point that turns user errors into one clear line."""
    try:
        # Without standalone mode click returns typer.Exit's code instead of exiting.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except UserError as err:
        typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        sys.exit(err.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except (typer.Exit,) as ex:
        sys.exit(ex.exit_code)
    except SystemExit:
        raise
    except Exception as ex:  # click usage errors come through here in non-standalone mode
        import click

        if isinstance(ex, click.ClickException):
            ex.show()
            sys.exit(ex.exit_code)
        raise

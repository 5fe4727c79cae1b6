"""The one way a ``pointforge`` command line ends: its exit status and its last words.

Both entry points run through :func:`run`: ``pointforge`` (:func:`pointforge.cli.main.main`)
and the per-rank ``python -m pointforge`` that torchrun starts. So a
user error is one red line and exit 2 (its ``exit_code``) everywhere, a
usage error is click's message and exit 2, and an unexpected error is a
traceback and exit 1. The module sits below every command module, so none of
them has to import the root app to share this.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback
from typing import Any, NoReturn, Sequence

import typer

from pointforge.errors import DiskFullError, UserError, disk_full_cause


def run(app: typer.Typer, args: Sequence[str] | None = None) -> int:
    """Run ``app`` (on ``args``, default ``sys.argv[1:]``) and return its exit status; never raises."""
    try:
        result = app(args=list(args) if args is not None else None, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except UserError as err:
        typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        return err.exit_code
    except SystemExit as ex:
        return ex.code if isinstance(ex.code, int) else (0 if ex.code is None else 1)
    except KeyboardInterrupt:
        return 130
    except Exception as ex:
        # Typer carries its own copy of click, so its usage errors are known by
        # their shape (show() and an exit code), not by a class imported here.
        if callable(getattr(ex, "show", None)) and isinstance(getattr(ex, "exit_code", None), int):
            usage: Any = ex
            usage.show()
            return usage.exit_code
        if type(ex).__name__ == "Abort":
            typer.echo("Aborted!", err=True)
            return 1
        full = disk_full_cause(ex)
        if full is not None:
            typer.secho(f"error: {_disk_full_line(full)}", err=True, fg=typer.colors.RED)
            return DiskFullError.exit_code
        traceback.print_exc()
        return 1


def _disk_full_line(cause: OSError) -> str:
    """A full disk met outside the paths that say it themselves (checkpoints do): what, where, what to do."""
    what = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left on the device"
    where = f" while writing {cause.filename}" if cause.filename else ""
    return (
        f"{what}{where}; free some space or write somewhere else (--out). "
        "Files already written are whole: pointforge writes each one to a temporary name and renames it when complete"
    )


def hard_exit(code: int) -> NoReturn:
    """End the process now with ``code``, skipping the interpreter's teardown.

    After a failed collective, torch's process-group destructors can block or
    abort; a rank must end with its status, not hang on the way out. Skipping
    the slow module teardown also lets torchrun see the exit, and restart or
    finish, a second sooner per rank. Everything the run owns (loaders, logs,
    writers, process group) is closed before this is called.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

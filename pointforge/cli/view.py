"""`pointforge view`: a turnable 3-D page (view.html) of a generated case or of any implant file."""

from __future__ import annotations

from pathlib import Path

import typer


def view(
    target: Path = typer.Argument(
        ...,
        help="A case folder written by `pointforge generate`, or an implant volume (.nrrd/.nii/.nii.gz) with --skull.",
    ),
    skull: Path = typer.Option(None, "--skull", help="With an implant file: the defective skull it fills (same grid)."),
    out: Path = typer.Option(
        None,
        "--out",
        help="Where to write the page (default: CASE_DIR/view.html, or IMPLANT's folder/<name>.view.html).",
    ),
) -> None:
    """Write a web page showing the defective skull and the implant in 3-D (mm, offline; plotly.min.js beside it)."""
    from pointforge.errors import UserError
    from pointforge.implant.view import case_layers, file_layers, write_view

    if target.is_dir():
        if skull is not None:
            raise typer.BadParameter(
                "--skull is for an implant file; a case folder holds its own skull", param_hint="--skull"
            )
        layers = case_layers(target)
        page = out or target / "view.html"
    elif target.is_file():
        if skull is None:
            raise UserError(
                f"{target} is a file: give the defective skull it fills with --skull, or give a case folder"
            )
        layers = file_layers(target, skull)
        page = out or target.parent / f"{target.name.split('.')[0]}.view.html"
    else:
        raise UserError(f"{target}: no such file or folder; give a case folder or an implant volume")
    written = write_view(page, layers)
    size = written.stat().st_size / 1e6
    typer.echo(f"wrote {written} ({size:.1f} MB; plotly.min.js beside it) — open it in a web browser")

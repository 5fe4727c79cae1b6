"""`pointforge evaluate-upsampling`."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import progress_bar


def evaluate_upsampling(
    pred: Path = typer.Argument(..., help="Folder of upsampled clouds (.npy, .ply, .las, .laz)."),
    truth: Path = typer.Option(..., "--truth", help="Folder of dense clouds, paired with PRED's by file name."),
    out: Path = typer.Option(None, "--out", help="Where to write upsampling_metrics.csv/.json (default: PRED)."),
    surface_k: int = typer.Option(10, "--surface-k", help="Dense points whose plane stands in for the surface."),
    workers: int = typer.Option(1, "--workers", help="Threads for the KD-tree queries (-1: all cores)."),
) -> None:
    """Chamfer, Hausdorff, point-to-surface and uniformity of each upsampled cloud against its dense truth."""
    from rich.console import Console
    from rich.table import Table

    from pointforge.upsampling.evaluate import COLUMNS, evaluate_upsampling, write_upsampling_reports

    with progress_bar("scoring") as advance:
        result = evaluate_upsampling(
            pred, truth, surface_k=surface_k, workers=workers, progress=lambda d, t: advance(completed=d, total=t)
        )
    paths = write_upsampling_reports(result, out or pred)
    units = {"chamfer": " (units²)", "hausdorff": " (units)", "p2s": " (units)"}
    table = Table(title=f"{len(result.rows)} pairs scored, {len(result.missing)} missing ({result.seconds:.1f} s)")
    table.add_column("metric")
    table.add_column("mean ± sd [median]", justify="right")
    for m in COLUMNS:
        s = result.summary[m]
        table.add_row(m + units.get(m, ""), f"{s['mean']:.4g} ± {s['std']:.3g} [{s['median']:.4g}]")
    Console().print(table)
    if result.missing:
        shown = ", ".join(result.missing[:8]) + (" ..." if len(result.missing) > 8 else "")
        typer.secho(
            f"no prediction for {len(result.missing)} dense cloud(s): {shown}", err=True, fg=typer.colors.YELLOW
        )
    typer.echo(f"wrote {paths['csv']} and {paths['json']}")

"""`pointforge demo`."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import progress_bar


def demo(
    out: Path = typer.Option(Path("demo_out"), "--out", help="Folder for everything the demo writes."),
    skulls: int = typer.Option(6, "--skulls", min=2, help="Synthetic skulls (5 defect cases each)."),
    size: int = typer.Option(128, "--size", help="Volume size S (S³)."),
    points: int = typer.Option(30_000, "--points", help="Surface points per volume."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Run the whole system on synthetic data: nothing to download, nothing to configure."""
    from rich.console import Console
    from rich.table import Table

    from pointforge.demo import run_demo

    with progress_bar("preparing") as advance:
        res = run_demo(out, skulls=skulls, size=size, seed=seed, points=points,
                       progress=lambda done, total, name: advance(completed=done, total=total))
    table = Table(title="pointforge demo")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("skulls / cases", f"{res.skulls} / {res.cases}")
    table.add_row("volume size", f"{res.size}³")
    table.add_row("points per surface", f"{res.points_per_surface:,}")
    table.add_row("split (cases)", ", ".join(f"{k} {v}" for k, v in res.split_counts.items()))
    for k, v in res.timings.items():
        table.add_row(k.replace("_s", " (s)"), f"{v:.1f}")
    table.add_row("total (s)", f"{sum(res.timings.values()):.1f}")
    Console().print(table)
    typer.echo(f"preview: {res.preview}")
    typer.echo(f"summary: {res.out / 'summary.json'}")

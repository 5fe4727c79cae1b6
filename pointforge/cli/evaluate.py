"""`pointforge evaluate`."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import progress_bar


def evaluate(
    pred: Path = typer.Argument(..., help="Folder of predicted implants (generate's output or a dataset-like layout)."),
    truth: Path = typer.Option(..., "--truth", help="Ground-truth dataset root (SkullBreak or SkullFix layout)."),
    out: Path = typer.Option(None, "--out", help="Where to write metrics.csv and metrics.json (default: PRED)."),
    margin_mm: float = typer.Option(10.0, "--margin-mm", help="bDSC: distance to the defective skull in mm."),
) -> None:
    """DSC, bDSC and HD95 per case and per defect class (AutoImplant definitions)."""
    from rich.console import Console
    from rich.table import Table

    from pointforge.implant.evaluate import METRICS, evaluate_predictions, write_reports

    with progress_bar("evaluating") as advance:
        result = evaluate_predictions(
            pred, truth, margin_mm=margin_mm, progress=lambda done, total: advance(completed=done, total=total)
        )
    paths = write_reports(result, out or pred)
    table = Table(title=f"{len(result.rows)} cases scored, {len(result.missing)} missing ({result.seconds:.1f} s)")
    table.add_column("group")
    table.add_column("n", justify="right")
    for m in METRICS:
        table.add_column(f"{m.upper()} mean ± sd [median]" + (" (mm)" if m.startswith("hd") else ""), justify="right")
    for group, stats in result.summary.items():
        table.add_row(
            group,
            str(stats["dsc"]["n"]),
            *[f"{stats[m]['mean']:.3f} ± {stats[m]['std']:.3f} [{stats[m]['median']:.3f}]" for m in METRICS],
        )
    Console().print(table)
    for row in result.rows:
        if row.get("error"):
            typer.secho(f"case {row['case_id']}: {row['error']}", err=True, fg=typer.colors.YELLOW)
    if result.missing:
        shown = ", ".join(result.missing[:8]) + (" ..." if len(result.missing) > 8 else "")
        typer.secho(f"no prediction for {len(result.missing)} case(s): {shown}", err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {paths['csv']} and {paths['json']}")

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

    from pointforge.implant.evaluate import evaluate_predictions, write_reports

    with progress_bar("scoring cases") as advance:
        result = evaluate_predictions(
            pred, truth, margin_mm=margin_mm, progress=lambda done, total: advance(completed=done, total=total)
        )
    paths = write_reports(result, out or pred)
    console = Console()
    title = f"{len(result.rows)} cases scored, {len(result.missing)} missing ({result.seconds:.1f} s)"
    console.print(summary_table(result.summary, "mean ± sd", title))
    console.print(summary_table(result.summary, "median", "medians"))
    for row in result.rows:
        if row.get("error"):
            typer.secho(f"case {row['case_id']}: {row['error']}", err=True, fg=typer.colors.YELLOW)
    if result.missing:
        shown = ", ".join(result.missing[:8]) + (" ..." if len(result.missing) > 8 else "")
        typer.secho(f"no prediction for {len(result.missing)} case(s): {shown}", err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {paths['csv']} (per case, with HD) and {paths['json']}")


def summary_table(summary: dict, what: str, title: str):
    """One rich table per statistic (``mean ± sd`` or ``median``), so it fits 80 columns without wrapping."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("group")
    table.add_column("n", justify="right")
    metrics = (("dsc", "DSC", 3), ("bdsc", "bDSC", 3), ("hd95", "HD95 mm", 2))
    for _, name, _ in metrics:
        table.add_column(f"{name} {what}", justify="right", no_wrap=True)
    for group, stats in summary.items():
        cells = []
        for key, _, digits in metrics:
            m = stats[key]
            if not m["n"]:
                cells.append("–")
            elif what == "median":
                cells.append(f"{m['median']:.{digits}f}")
            else:
                cells.append(f"{m['mean']:.{digits}f} ± {m['std']:.{digits}f}")
        table.add_row(group, str(stats["dsc"]["n"]), *cells)
    return table

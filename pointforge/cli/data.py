"""`pointforge data ...`: synthesise and prepare skull datasets."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import progress_bar

app = typer.Typer(help="Synthesise and prepare skull datasets.", no_args_is_help=True)


@app.command("synth")
def synth(
    out: Path = typer.Argument(..., help="Folder to write the dataset into."),
    skulls: int = typer.Option(4, "--skulls", min=1, help="Number of skulls."),
    size: int = typer.Option(128, "--size", help="Grid size S (S³ volumes; SkullFix: S×S×Z). 64 to 512."),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed gives the same files."),
    layout: str = typer.Option("skullbreak", "--layout", help="skullbreak or skullfix."),
    family: str = typer.Option(
        "domes", "--family", help="Skull family: domes (fast, plausible vaults) or anatomical (a real head, deformed)."
    ),
) -> None:
    """Write a synthetic SkullBreak- or SkullFix-style dataset."""
    from pointforge.data.synthetic.dataset import synthesize

    with progress_bar("synthesising", total=skulls) as advance:
        summary = synthesize(
            out,
            skulls,
            size,
            seed,
            layout=layout,
            progress=lambda done, total, name: advance(completed=done, total=total),
            family=family,
        )
    n_cases = sum(max(1, len(c.get("defects", {}))) for c in summary["cases"])
    typer.echo(
        f"wrote {n_cases} cases from {skulls} {family} skulls ({layout}, {size}) to {out} in {summary['seconds']:.1f} s"
    )


@app.command("prepare")
def prepare(
    root: Path = typer.Argument(..., help="Raw dataset in the SkullBreak or SkullFix layout."),
    out: Path = typer.Option(..., "--out", help="Folder for the prepared dataset."),
    points: int = typer.Option(400_000, "--points", help="Surface points per volume."),
    split: str = typer.Option("0.7,0.1,0.2", "--split", help="train,val,test ratios (grouped by skull)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the split and the point sampling."),
    workers: int = typer.Option(0, "--workers", help="Parallel processes (0: up to 4, one per core)."),
    isotropic_spacing: float = typer.Option(
        0.0, "--isotropic-spacing", help="SkullFix: resample to this spacing in mm (0: the finest axis)."
    ),
) -> None:
    """Turn volumes into surface point clouds, a split and a manifest. Resumable."""
    from pointforge.data.prepare import prepare_dataset

    with progress_bar("preparing") as advance:
        result = prepare_dataset(
            root,
            out,
            n_points=points,
            split=split,
            seed=seed,
            workers=workers or None,
            isotropic_spacing=isotropic_spacing or None,
            progress=lambda done, total, name: advance(completed=done, total=total),
        )
    counts = ", ".join(f"{k} {v}" for k, v in result.split_counts.items())
    typer.echo(
        f"{result.layout}: {len(result.cases)} cases ({counts}); {result.done} volumes prepared, "
        f"{result.skipped} already done, {len(result.failures)} failed; {result.seconds:.1f} s → {out}"
    )
    if result.failures:
        for line in result.failures:
            typer.secho(f"failed: {line}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)

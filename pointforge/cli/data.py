"""`pointforge data ...`: synthesise and prepare skull datasets; real lidar as upsampler pairs."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import progress_bar

app = typer.Typer(
    help="Synthesise and prepare skull datasets; cut real lidar into upsampler pairs.", no_args_is_help=True
)


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
    split: str = typer.Option(
        "0.7,0.1,0.2",
        "--split",
        help="train,val,test ratios (seeded, grouped by skull); or skull ids, e.g. "
        "train=000-059,val=060-069,test=070-079 (skulls not named are left out, never read); or a named split: skullfix.",
    ),
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
    _exit_on_failures(result.failures)


@app.command("cut-defects")
def cut_defects(
    root: Path = typer.Argument(..., help="A SkullFix or SkullBreak folder holding complete_skull/NNN.nrrd."),
    out: Path = typer.Option(..., "--out", help="Folder for the new SkullBreak-layout dataset."),
    split: str = typer.Option(
        ...,
        "--split",
        help="Which skulls, as data prepare takes them: skull ids (e.g. train=000-059,val=060-069) or a named "
        "split (skullfix); skulls not named are never read. Ratios take every skull.",
    ),
    seed: int = typer.Option(0, "--seed", help="With the skull id and class, draws each defect; one seed per --out."),
    workers: int = typer.Option(0, "--workers", help="Parallel processes (0: up to 4, one per core)."),
) -> None:
    """Cut the five SkullBreak defect classes from each complete skull (its own grid and header). Resumable."""
    from pointforge.data.skulls.cutting import cut_dataset

    with progress_bar("cutting skulls") as advance:
        result = cut_dataset(
            root,
            out,
            split=split,
            seed=seed,
            workers=workers or None,
            progress=lambda done, total, name: advance(completed=done, total=total),
        )
    typer.echo(
        f"{result.done} skulls cut, {result.skipped} already done, {len(result.failures)} failed; "
        f"{result.seconds:.1f} s → {out}"
    )
    _exit_on_failures(result.failures)


def _exit_on_failures(failures: list[str]) -> None:
    """Each failed volume's line on stderr and exit 1; nothing when none failed (the others are written)."""
    if failures:
        for line in failures:
            typer.secho(f"failed: {line}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)


@app.command("verify")
def verify(
    root: Path = typer.Argument(..., help="A downloaded dataset's root folder (holding complete_skull/ ...)."),
    dataset: str = typer.Option("skullfix", "--dataset", help="Which published checksum list: skullfix."),
) -> None:
    """Check a download against the sha256 list pointforge ships (the files its recipes read)."""
    from pointforge.data.skulls.checksums import verify as verify_files

    with progress_bar("hashing") as advance:
        result = verify_files(root, dataset, progress=lambda done, total, _rel: advance(completed=done, total=total))
    total = len(result.ok) + len(result.missing) + len(result.changed)
    for label, names in (("missing", result.missing), ("changed", result.changed)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            typer.secho(f"{label}: {shown}", err=True, fg=typer.colors.RED)
    if not result.passed:
        typer.secho(
            f"{root}: {len(result.ok)} of {total} files match the {dataset} list; "
            "download the missing or changed files again (docs/data.md says where)",
            err=True,
            fg=typer.colors.RED,
        )
        raise typer.Exit(1)
    typer.echo(f"{root}: all {total} listed {dataset} files match")


@app.command("lidar")
def lidar(
    out: Path = typer.Argument(..., help="Folder for the tiles, pairs and manifests."),
    scan: list[str] = typer.Option(
        None, "--scan", help="Public scan fetched through pip: nimes, forest (default both unless --las is given)."
    ),
    las: list[Path] = typer.Option(None, "--las", help="A dense LAS/LAZ scan of your own (repeatable)."),
    sparse_survey: Path = typer.Option(
        None, "--sparse-survey", help="A sparse survey of the same area as the one --las: pairs by protocol 'survey'."
    ),
    protocol: list[str] = typer.Option(
        None, "--protocol", help="Thinning protocol(s): random, lines, voxel (default all three)."
    ),
    ratio: float = typer.Option(2.0, "--ratio", help="Dense points per sparse point."),
    tile: float = typer.Option(30.0, "--tile", help="Tile side in metres."),
    gap: float = typer.Option(5.0, "--gap", help="Metres dropped between the train, validation and test areas."),
    seed: int = typer.Option(0, "--seed", help="Seed of the thinning; the same seed gives the same files."),
    cache: Path = typer.Option(
        None, "--cache", help="Where fetched scans are kept (default ~/.cache/pointforge/lidar)."
    ),
) -> None:
    """Real airborne lidar as sparse/dense pairs: tiles split by area into train / val / test (docs/upsampler.md)."""
    from pointforge.data.lidar.areas import AreaSplit, build_pairs
    from pointforge.data.lidar.scans import fetch_scan
    from pointforge.data.lidar.thinning import PROTOCOLS
    from pointforge.errors import ConfigError

    own = {path.stem: path for path in las or []}
    if sparse_survey is not None and len(own) != 1:
        raise ConfigError("--sparse-survey pairs with exactly one --las (the dense survey of the same area)")
    names = scan or ([] if own else ["nimes", "forest"])
    scans = {name: fetch_scan(name, cache) for name in names} | own
    surveys = {next(iter(own)): sparse_survey} if sparse_survey is not None else None
    with progress_bar("scans", total=len(scans)) as advance:
        summary = build_pairs(
            out,
            scans,
            protocols=protocol or PROTOCOLS,
            ratio=ratio,
            split=AreaSplit(tile=tile, gap=gap),
            seed=seed,
            sparse_surveys=surveys,
            progress=lambda done, total, name: advance(completed=done, total=total),
        )
    counts = {part: sum(t["split"] == part for t in summary["tiles"]) for part in ("train", "val", "test")}
    typer.echo(
        f"{len(scans)} scan(s) → {counts['train']} train, {counts['val']} val, {counts['test']} test tiles; "
        f"manifests {', '.join(sorted(summary['manifests']))} under {out}"
    )

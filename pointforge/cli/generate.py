"""`pointforge generate`: a defective skull (or a dataset of them) → implants."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pointforge.cli.progress import Bars

if TYPE_CHECKING:
    from pointforge.implant.printable import PrintOptions


# The options that take more than a line, named once here so that generate's signature reads as a list.
_DEFECTIVE = typer.Argument(
    ...,
    help="A defective skull (.nrrd/.nii/.nii.gz), a CT DICOM series (a folder or .zip of its files; "
    "the outputs then include a DICOM SEG and Encapsulated STL), or a dataset folder: "
    "a prepared dataset (its --split is processed) or a raw SkullBreak/SkullFix one.",
)
_PCDIFF = typer.Option(None, "--pcdiff", help="PCDiff checkpoint (pointforge train pcdiff, or ckpt import-pcdiff).")
_UNET = typer.Option(
    None,
    "--unet",
    help="Instead of --pcdiff and --voxelizer: a volumetric U-Net checkpoint (pointforge train unet); "
    "one defective skull file, no ensemble.",
)
_THREADS = typer.Option(
    None, "--threads", help="CPU threads (default: the cores this process may use, container limits included)."
)
_SPLIT = typer.Option("test", "--split", help="Dataset mode: the split of a prepared dataset (train/val/test/all).")
_UPSAMPLE = typer.Option(
    None, "--upsample", help="Optional upsampler checkpoint: densify each proposal before voxelising."
)
_COMPONENTS = typer.Option(
    0.2,
    "--components",
    help="Clean-up keeps every implant component of at least this fraction of the largest "
    "(1: the largest only, as upstream; 0.2 keeps both plates of a bilateral defect).",
)
_REACH_MM = typer.Option(
    None,
    "--reach-mm",
    help="Clean-up keeps only implant voxels within this many mm of a generated implant point "
    "(default: the whole ball around the points, as upstream).",
)
_SKULL_POINTS = typer.Option(
    None,
    "--skull-points",
    help="Defective-skull points the voxelizer is given beside each proposal's implant points "
    "(default: as many as it was trained on; docs/implant.md).",
)
_LABEL = typer.Option(
    None,
    "--label",
    help="Foreground value of the written masks (default: the input's own, e.g. 255 for a 0/255 skull).",
)
_PRINTABLE = typer.Option(
    None,
    "--printable",
    help="Also write a print-ready STL (for a dataset folder: of every case) of 'vote' (the implant) or proposal K (0, 1, ...); "
    "the default when --min-thickness or --margin is given is vote.",
)
_MIN_THICKNESS = typer.Option(
    None, "--min-thickness", help="Print-ready STL: grow the implant to at least this wall thickness (mm)."
)
_MARGIN = typer.Option(
    None, "--margin", help="Print-ready STL: a flange this many mm onto the skull around the defect (mm)."
)


_PICTURES = typer.Option(
    False,
    "--pictures",
    help="Also write preview.png and view.html (3-D) into each case (off by default: about 4 s of a paper-scale "
    "case on 2 cores; `pointforge view CASE` writes the page later).",
)


def generate(
    defective: Path = _DEFECTIVE,
    pcdiff: Path = _PCDIFF,
    voxelizer: Path = typer.Option(None, "--voxelizer", help="Voxelizer checkpoint (pointforge train voxelizer)."),
    unet: Path = _UNET,
    out: Path = typer.Option(..., "--out", help="Output folder (one case), or the root of one folder per case."),
    ensemble: int = typer.Option(5, "--ensemble", "-n", help="Number of implant proposals, sampled in one batch."),
    sampler: str = typer.Option("ddim", "--sampler", help="ddpm (all T steps, as upstream), ddim or dpm++2m."),
    steps: int = typer.Option(None, "--steps", help="Sampler steps (default: ddim 7, dpm++2m 20; ddpm runs all T)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    threads: int = _THREADS,
    seed: int = typer.Option(0, "--seed", help="Seeds the conditioning subsample and the starting noise."),
    split: str = _SPLIT,
    upsample: Path = _UPSAMPLE,
    overwrite: bool = typer.Option(False, "--overwrite", help="One case: replace an existing --out folder."),
    components: float = _COMPONENTS,
    reach_mm: float = _REACH_MM,
    skull_points: int = _SKULL_POINTS,
    label: float = _LABEL,
    printable: str = _PRINTABLE,
    min_thickness: float = _MIN_THICKNESS,
    margin: float = _MARGIN,
    pictures: bool = _PICTURES,
) -> None:
    """Design an implant: PCDiff proposals → voxelizer → vote → clean-up → NRRD/NIfTI, STL, uncertainty, report.

    With --unet instead: the volumetric U-Net peer's implant, the same files.
    """
    from pointforge.data.dicom import is_dicom_series
    from pointforge.devices import use_threads
    from pointforge.implant.models import load_models
    from pointforge.implant.options import GenerateOptions

    to_print = _print_options(printable, min_thickness, margin, proposals=1 if unet is not None else ensemble)
    if unet is not None:
        if pcdiff is not None or voxelizer is not None:
            raise typer.BadParameter("give either --unet, or --pcdiff with --voxelizer, not both", param_hint="--unet")
        use_threads(threads)
        _generate_unet(
            defective,
            out,
            unet,
            device=device,
            components=components,
            overwrite=overwrite,
            label=label,
            pictures=pictures,
        )
        _write_printable(out, defective, to_print)
        return
    if pcdiff is None or voxelizer is None:
        raise typer.BadParameter(
            "give --pcdiff and --voxelizer (the PCDiff pipeline), or --unet (the U-Net peer)",
            param_hint="--pcdiff" if pcdiff is None else "--voxelizer",
        )
    options = GenerateOptions(
        ensemble=ensemble,
        sampler=sampler,
        steps=steps,
        seed=seed,
        components=components,
        reach_mm=reach_mm,
        skull_points=skull_points,
    )
    use_threads(threads)
    dataset = defective.is_dir() and not is_dicom_series(defective)
    if dataset:
        from pointforge.implant.folder import cases_of

        cases_of(defective, split)  # a wrong folder or split fails here, before the models load
    elif not defective.exists():
        raise typer.BadParameter(f"{defective}: no such file or folder", param_hint="DEFECTIVE")
    models = load_models(pcdiff, voxelizer, device=device, upsample=upsample)
    if dataset:
        _generate_folder(
            defective, out, models, options, split=split, label=label, printable=to_print, pictures=pictures
        )
    else:
        _generate_case(defective, out, models, options, overwrite=overwrite, label=label, pictures=pictures)
        _write_printable(out, defective, to_print)


def _print_options(
    choice: str | None, min_thickness: float | None, margin: float | None, *, proposals: int
) -> PrintOptions | None:
    """The print-ready STL's options (checked here, before any work), or None when none was asked for."""
    if choice is None and min_thickness is None and margin is None:
        return None
    from pointforge.errors import ConfigError
    from pointforge.implant.printable import PrintOptions

    options = PrintOptions(choice=choice or "vote", min_thickness_mm=min_thickness or 0.0, margin_mm=margin or 0.0)
    if options.proposal is not None and options.proposal >= proposals:
        raise ConfigError(
            f"--printable {options.proposal}: this run makes proposals 0 to {proposals - 1}; choose one or 'vote'"
        )
    return options


def _write_printable(case: Path, defective: Path, options: PrintOptions | None) -> None:
    if options is None:
        return
    from pointforge.implant.printable import write_printable

    stl, measured = write_printable(case, defective, options)
    thick = f"at least {options.min_thickness_mm:g} mm" if options.min_thickness_mm else "thickness as generated"
    flange = f", margin {options.margin_mm:g} mm" if options.margin_mm else ""
    typer.echo(
        f"print-ready STL ({options.choice}, {thick}{flange}): measured minimum "
        f"thickness {measured['measured_min_thickness_mm']:g} mm, "
        f"{'watertight' if measured['watertight'] else 'NOT watertight'}, {measured['volume_cm3']:g} cm³, "
        f"{measured['overlap_with_skull_mm3']:g} mm³ on bone → {stl}"
    )


def _generate_unet(
    defective: Path, out: Path, checkpoint: Path, *, device: str, components: float, overwrite, label, pictures: bool
):
    from pointforge.errors import UserError
    from pointforge.implant.unet import generate_unet_case, load_generator

    if defective.is_dir():
        raise UserError(f"{defective}: --unet takes one defective skull file, not a folder")
    if not defective.exists():
        raise typer.BadParameter(f"{defective}: no such file", param_hint="DEFECTIVE")
    loaded = load_generator(checkpoint, device)
    report = generate_unet_case(
        defective,
        out,
        loaded,
        components=components,
        overwrite=overwrite,
        label=label,
        log=typer.echo,
        preview=pictures,
        view=pictures,
    )
    _say_case(report, out)


def _stage_bars(bars: Bars):
    def on_step(stage: str, done: int, total: int) -> None:
        what = {"sample": "sampler steps", "voxelize": "proposals voxelised"}.get(stage, stage)
        bars.update(stage, done, total=total, description=what)

    return on_step


def _generate_folder(
    defective: Path, out: Path, models, options, *, split: str, label, printable, pictures: bool
) -> None:
    from pointforge.implant.folder import generate_folder

    with Bars() as bars:
        result = generate_folder(
            defective,
            out,
            models,
            options,
            split=split,
            log=lambda msg: typer.secho(msg, err=True, fg=typer.colors.YELLOW),
            progress=lambda done, total: bars.update("cases", done, total=total, description=f"cases ({split} split)"),
            step_progress=_stage_bars(bars),
            label=label,
            printable=printable,
            pictures=pictures,
        )
    _say_folder(result, out, pictures)


def _generate_case(defective: Path, out: Path, models, options, *, overwrite: bool, label, pictures: bool) -> None:
    from pointforge.implant.case import generate_case

    with Bars() as bars:
        report = generate_case(
            defective,
            out,
            models,
            options,
            overwrite=overwrite,
            log=typer.echo,
            progress=_stage_bars(bars),
            label=label,
            preview=pictures,
            view=pictures,
        )
    _say_case(report, out)


def _say_case(report: dict, out: Path) -> None:
    mesh = report["mesh"]
    typer.echo(
        f"implant: {report['implant']['volume_cm3']:.2f} cm³, mesh {'watertight' if mesh['watertight'] else 'NOT watertight'}"
        f" ({mesh['components']} component{'s' if mesh['components'] != 1 else ''}), "
        f"{report['timings_s']['total_s']:.1f} s → {out} ({_view_hint(out, 'view' in report['outputs'])})"
    )


def _view_hint(case: Path, written: bool) -> str:
    return f"3-D view: {case / 'view.html'}" if written else f"3-D view: pointforge view {case}"


def _say_folder(result, out: Path, pictures: bool) -> None:
    typer.echo(
        f"{len(result.done)} generated, {len(result.skipped)} already done, {len(result.failed)} failed "
        f"({result.seconds:.0f} s) → {out} ({_view_hint(out / '<case>', pictures).replace('view:', 'views:')})"
    )
    if result.printed:
        typer.echo(f"{len(result.printed)} print-ready STL(s), each with its measurements: {out}/<case>/printable/")
    for case_id, message in result.failed.items():
        typer.secho(f"case {case_id}: {message}", err=True, fg=typer.colors.RED)
    if result.failed:
        raise typer.Exit(1)

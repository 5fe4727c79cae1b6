"""`pointforge upsample`: densify a point cloud file with a trained upsampler or a geometric baseline.

Register with the root app::

    from pointforge.cli.upsample import upsample as upsample_command
    app.command("upsample")(upsample_command)
"""

from __future__ import annotations

from pathlib import Path

import typer


def upsample(
    input: Path = typer.Argument(..., help="Sparse point cloud: .npy, .ply, .las or .laz."),
    out: Path = typer.Option(..., "--out", "-o", help="Dense point cloud to write: .npy, .ply, .las or .laz."),
    ckpt: Path = typer.Option(
        None, "--ckpt", help="Checkpoint written by `pointforge train upsampler` (e.g. .../checkpoints/best.pt)."
    ),
    method: str = typer.Option(
        None,
        "--method",
        help="model (the checkpoint; the default when --ckpt is given), or a geometric baseline: "
        "plane (local-plane fit), midpoint (k-NN edge midpoints), input (each point repeated).",
    ),
    ratio: int = typer.Option(
        2, "--ratio", help="Output points per input point, for a baseline (a model has its own)."
    ),
    device: str = typer.Option("auto", "--device", help="auto (a GPU if there is one), cpu, cuda or cuda:N."),
    tile_points: int = typer.Option(
        None,
        "--tile-points",
        help="Most points per tile, margins included (default 100,000, fewer when memory is short). "
        "Larger clouds are upsampled tile by tile.",
    ),
) -> None:
    """Densify INPUT; coordinates stay in the input's frame (LAS keeps scales, offsets, CRS).

    With a model, a cloud of any size: larger than one tile, it is cut into
    overlapping tiles, streamed from and to disk, and stitched without seams or
    duplicates. A baseline reads the cloud whole. Compare them on your own data
    with `pointforge evaluate-upsampling`.
    """
    from pointforge.cli.progress import progress_bar
    from pointforge.errors import ConfigError
    from pointforge.upsampling.pipeline import baseline_file, upsample_file

    chosen = method or ("model" if ckpt is not None else None)
    if chosen is None:
        raise ConfigError("give --ckpt (a trained upsampler) or --method plane|midpoint|input (a geometric baseline)")
    if chosen == "model":
        if ckpt is None:
            raise ConfigError("--method model needs --ckpt, the checkpoint of a trained upsampler")
        with progress_bar("tiles") as advance:
            result = upsample_file(
                input,
                out,
                ckpt,
                device=device,
                tile_points=tile_points,
                progress=lambda d, t: advance(completed=d, total=t),
            )
    else:
        if ckpt is not None:
            raise ConfigError(f"--method {chosen} uses no checkpoint; drop --ckpt or use --method model")
        result = baseline_file(input, out, chosen, ratio)
    tiles = f" in {result.tiles} tiles" if result.tiles > 1 else ""
    typer.echo(
        f"{result.points_in} → {result.points_out} points{tiles} in {result.seconds:.1f} s; wrote {result.output}"
    )

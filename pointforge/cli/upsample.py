"""`pointforge upsample`: densify a point cloud file with a trained upsampler.

Register with the root app::

    from pointforge.cli.upsample import upsample as upsample_command
    app.command("upsample")(upsample_command)
"""

from __future__ import annotations

from pathlib import Path

import typer


def upsample(
    input: Path = typer.Argument(..., help="Sparse point cloud: .npy, .ply, .las or .laz."),
    ckpt: Path = typer.Option(
        ..., "--ckpt", help="Checkpoint written by `pointforge train upsampler` (e.g. .../checkpoints/best.pt)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Dense point cloud to write: .npy, .ply, .las or .laz."),
    device: str = typer.Option("auto", "--device", help="auto (a GPU if there is one), cpu, cuda or cuda:N."),
    tile_points: int = typer.Option(
        None,
        "--tile-points",
        help="Most points per tile, margins included (default 100,000, fewer when memory is short). "
        "Larger clouds are upsampled tile by tile.",
    ),
) -> None:
    """Densify INPUT by the checkpoint's ratio; coordinates stay in the input's frame (LAS keeps scales, offsets, CRS).

    A cloud of any size: larger than one tile, it is cut into overlapping tiles,
    streamed from and to disk, and stitched without seams or duplicates.
    """
    from pointforge.cli.progress import progress_bar
    from pointforge.upsampling.pipeline import upsample_file

    with progress_bar("tiles") as advance:
        result = upsample_file(
            input,
            out,
            ckpt,
            device=device,
            tile_points=tile_points,
            progress=lambda d, t: advance(completed=d, total=t),
        )
    tiles = f" in {result.tiles} tiles" if result.tiles > 1 else ""
    typer.echo(
        f"{result.points_in} → {result.points_out} points{tiles} in {result.seconds:.1f} s; wrote {result.output}"
    )

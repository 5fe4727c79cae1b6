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
) -> None:
    """Densify INPUT by the checkpoint's ratio; coordinates stay in the input's frame (LAS keeps scales, offsets, CRS)."""
    from pointforge.inference.upsampler import upsample_file

    result = upsample_file(input, out, ckpt, device=device)
    typer.echo(f"{result.points_in} → {result.points_out} points in {result.seconds:.1f} s; wrote {result.output}")

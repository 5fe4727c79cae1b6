"""`pointforge serve`: the implant service and its web page."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def serve(
    pcdiff: Path = typer.Option(..., "--pcdiff", help="PCDiff checkpoint (pointforge train pcdiff)."),
    voxelizer: Path = typer.Option(..., "--voxelizer", help="Voxelizer checkpoint (pointforge train voxelizer)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback needs --token."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free one, printed at start)."),
    workers: int = typer.Option(1, "--workers", help="Cases generated at the same time (threads sharing the models)."),
    data_dir: Path = typer.Option(
        Path("pointforge-serve"), "--data-dir", help="Jobs (SQLite), uploads and cases; back this folder up."
    ),
    token: str = typer.Option(
        None, "--token", envvar="POINTFORGE_SERVE_TOKEN", help="Required from every client (prefer the env variable)."
    ),
    public_url: str = typer.Option(
        None, "--public-url", help="Behind a reverse proxy: the address browsers use (https://host), kept as Host."
    ),
    max_upload_mb: float = typer.Option(512, "--max-upload-mb", help="Largest upload accepted."),
    max_disk_gb: float = typer.Option(
        20, "--max-disk-gb", help="Finished cases beyond this are evicted, oldest first."
    ),
    ensemble: int = typer.Option(5, "--ensemble", "-n", help="Implant proposals per case."),
    sampler: str = typer.Option("ddim", "--sampler", help="ddpm, ddim or dpm++2m."),
    steps: int = typer.Option(None, "--steps", help="Sampler steps (default: the sampler's)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: the cores this process may use)."),
) -> None:
    """Serve implant design over HTTP: upload a defective skull or a CT series, follow the queue, view and download."""
    from pointforge.devices import use_threads
    from pointforge.serve.service import serve as run_service
    from pointforge.serve.settings import ServeSettings

    settings = ServeSettings(
        data_dir=data_dir,
        host=host,
        port=port,
        workers=workers,
        token=token or os.environ.get("POINTFORGE_SERVE_TOKEN") or None,
        public_url=public_url,
        max_upload_mb=max_upload_mb,
        max_disk_gb=max_disk_gb,
        ensemble=ensemble,
        sampler=sampler,
        steps=steps,
    )
    settings.validate()
    use_threads(threads)
    run_service(settings, pcdiff, voxelizer, device=device, say=lambda line: typer.echo(line, err=True))

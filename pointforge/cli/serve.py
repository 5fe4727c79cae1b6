"""`pointforge serve`: the implant service and its web page; `pointforge serve token`: who may use it."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=False, help="Serve implant design over HTTP; manage its named tokens.")
token_app = typer.Typer(no_args_is_help=True, help="Named tokens, one per person (stored hashed in --data-dir).")
app.add_typer(token_app, name="token")

_DATA_DIR = typer.Option(Path("pointforge-serve"), "--data-dir", help="The service's data folder.")


@app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    pcdiff: Path = typer.Option(None, "--pcdiff", help="PCDiff checkpoint (pointforge train pcdiff)."),
    voxelizer: Path = typer.Option(None, "--voxelizer", help="Voxelizer checkpoint (pointforge train voxelizer)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback needs tokens."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free one, printed at start)."),
    workers: int = typer.Option(1, "--workers", help="Cases generated at the same time (threads sharing the models)."),
    data_dir: Path = typer.Option(
        Path("pointforge-serve"), "--data-dir", help="Jobs (SQLite), tokens, audit log, uploads, cases; back it up."
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
    if ctx.invoked_subcommand is not None:
        return
    if pcdiff is None or voxelizer is None:
        raise typer.BadParameter("give --pcdiff and --voxelizer (the trained models to serve)", param_hint="--pcdiff")
    from pointforge.devices import use_threads
    from pointforge.serve.service import serve as run_service
    from pointforge.serve.settings import ServeSettings

    settings = ServeSettings(
        data_dir=data_dir,
        host=host,
        port=port,
        workers=workers,
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


@token_app.command("add")
def token_add(
    name: str = typer.Argument(..., help="Whose token (the audit log records this name)."),
    admin: bool = typer.Option(False, "--admin", help="May also download the audit log."),
    data_dir: Path = _DATA_DIR,
) -> None:
    """Make a token for NAME and print it once (only its hash is kept)."""
    from pointforge.serve.tokens import TokenStore

    typer.echo(TokenStore(data_dir).add(name, admin=admin))


@token_app.command("revoke")
def token_revoke(name: str = typer.Argument(...), data_dir: Path = _DATA_DIR) -> None:
    """Revoke NAME's token: refused from the next request on, also by a running service."""
    from pointforge.serve.tokens import TokenStore

    TokenStore(data_dir).revoke(name)
    typer.echo(f"revoked {name}")


@token_app.command("list")
def token_list(data_dir: Path = _DATA_DIR) -> None:
    """Every token's name, role and state (never the token)."""
    from pointforge.serve.tokens import TokenStore

    for row in TokenStore(data_dir).listing():
        state = "revoked" if row["revoked"] else "live"
        typer.echo(f"{row['name']}\t{'admin' if row['admin'] else 'user'}\t{state}")

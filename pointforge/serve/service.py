"""`pointforge serve` as one function: lock the data folder, recover the queue, load the models, serve.

:func:`serve` returns when the server stops (Ctrl-C or SIGTERM: the workers
are told to stop; a job still running goes back to the queue without counting
as an attempt, and runs again at the next start).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from pointforge.errors import UserError
from pointforge.flock import exclusive_lock
from pointforge.implant.models import load_models
from pointforge.implant.options import GenerateOptions
from pointforge.serve.app import create_app
from pointforge.serve.settings import ServeSettings
from pointforge.serve.store import JobStore
from pointforge.serve.tokens import TOKENS_FILE, TokenStore
from pointforge.serve.worker import DataLayout, WorkerPool, keep_within

__all__ = ["serve"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog from now on, before uvicorn's loop starts
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host") from None
    return sock


def serve(
    settings: ServeSettings,
    pcdiff: str | os.PathLike,
    voxelizer: str | os.PathLike,
    *,
    device: str = "auto",
    say: Callable[[str], None] = print,
) -> None:
    """Run the service until it is stopped."""
    import uvicorn

    settings.validate()
    has_tokens = (Path(settings.data_dir) / TOKENS_FILE).is_file() and TokenStore(settings.data_dir).any_live()
    settings.check_reach(has_tokens)
    options = GenerateOptions(ensemble=settings.ensemble, sampler=settings.sampler, steps=settings.steps)
    layout = DataLayout(Path(settings.data_dir))
    with exclusive_lock(
        layout.root / "serve.lock",
        timeout_s=0,
        on_timeout=lambda: UserError(
            f"another pointforge serve uses {layout.root}; stop it or give another --data-dir"
        ),
    ):
        models = load_models(pcdiff, voxelizer, device=device)
        store = JobStore(layout.db)
        layout.clear_incoming()
        requeued, failed = store.recover()
        if requeued or failed:
            say(f"recovered after a stop: {requeued} job(s) queued again, {failed} marked failed")
        keep_within(store, layout, settings.max_disk_bytes)
        workers = WorkerPool(
            store, layout, models, options, count=settings.workers, max_disk_bytes=settings.max_disk_bytes
        ).start()
        sock = _bind(settings.host, settings.port)
        port = sock.getsockname()[1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        say(f"pointforge serve: listening on http://{host}:{port} (data in {layout.root})")
        stopped = False

        def stop() -> None:
            nonlocal stopped
            if stopped:
                return
            stopped = True
            workers.stop()
            released = store.release_running()
            if released:
                say(f"stopped: {released} running job(s) queued again for the next start")
            store.close()

        app = create_app(settings, store, layout, workers.wake, on_stop=stop)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        try:
            server.run(sockets=[sock])
        finally:
            stop()

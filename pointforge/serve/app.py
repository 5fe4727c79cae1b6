"""The FastAPI application: the page, the upload, the queue and the cases, every one an API call.

Routes (the OpenAPI schema is at ``/openapi.json``, browsable at ``/docs``):

* ``GET /`` the page; ``GET /static/app.js``, ``/static/style.css`` its script and style;
* ``POST /api/session`` ``{"token": ...}`` sets the token cookie the page uses;
* ``POST /api/cases?name=LABEL`` the file as the request body (``curl --data-binary @skull.nrrd``):
  checked, stored, queued; 201 with the job, or 400/413/415 with one line in ``detail``;
* ``GET /api/cases`` every job, newest first; ``GET /api/cases/{id}`` one job and its report's summary;
* ``GET /api/cases/{id}/files/{kind}`` a download (``implant``, ``uncertainty``, ``completed_skull``,
  ``stl``, ``report``; for a CT series in, ``seg`` and ``stl_dicom``); ``DELETE /api/cases/{id}`` removes a case that is not running;
* ``GET /cases/{id}/view.html`` the 3-D view `generate` writes (and ``/cases/plotly.min.js``).

Ids are made by the server and checked against the store before any file is
touched; the client's file name is kept as a label only.
"""

from __future__ import annotations

import json
import shutil
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pointforge import __version__
from pointforge.errors import DataError
from pointforge.serve.security import COOKIE, PAGE_CSP, guard, token_matches, view_csp
from pointforge.serve.settings import ServeSettings
from pointforge.serve.store import Job, JobStore, is_job_id, new_job_id
from pointforge.serve.uploads import check_upload
from pointforge.serve.worker import DataLayout

__all__ = ["create_app", "DOWNLOADS"]

DOWNLOADS = {"implant", "uncertainty", "completed_skull", "stl", "report", "seg", "stl_dicom"}
_MEDIA = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
_NAME_CHARS = 120


def _page_file(name: str) -> str:
    return resources.files("pointforge.serve").joinpath("page").joinpath(name).read_text(encoding="utf-8")


def _label(name: str | None) -> str:
    """The client's file name as a display label: printable characters, no folders."""
    base = (name or "upload").replace("\\", "/").rsplit("/", 1)[-1]
    return "".join(c for c in base if c.isprintable())[:_NAME_CHARS] or "upload"


def _summary(case: Path) -> dict[str, Any] | None:
    try:
        report = json.loads((case / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return {
        key: report.get(key) for key in ("implant", "mesh", "agreement", "timings_s", "parameters", "notes", "dicom")
    }


class _Cases:
    """The handlers that touch the store and the data folder."""

    def __init__(self, settings: ServeSettings, store: JobStore, layout: DataLayout, wake: Callable[[], None]):
        self.settings, self.store, self.layout, self.wake = settings, store, layout, wake

    def job(self, job_id: str) -> Job:
        job = self.store.get(job_id) if is_job_id(job_id) else None
        if job is None:
            raise HTTPException(404, "no such case")
        return job

    async def receive(self, request: Request, name: str | None) -> JSONResponse:
        limit = self.settings.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPException(413, f"the upload is {int(declared):,} bytes; the limit is {limit:,} (--max-upload-mb)")
        job_id = new_job_id()
        incoming = self.layout.incoming / f"{job_id}.part"
        try:
            size = 0
            with open(incoming, "wb") as handle:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise HTTPException(413, f"the upload is over the limit of {limit:,} bytes (--max-upload-mb)")
                    handle.write(chunk)
            if size == 0:
                raise HTTPException(400, "the upload is empty; send the file as the request body")
            checked = await run_in_threadpool(self._check, incoming, job_id)
        finally:
            incoming.unlink(missing_ok=True)
        job = self.store.add(job_id, _label(name), f"{job_id}{checked.suffix}", checked.kind)
        self.wake()
        return JSONResponse({**job.public(), "shape": list(checked.shape)}, status_code=201)

    def _check(self, incoming: Path, job_id: str):
        try:
            return check_upload(
                incoming,
                self.layout.uploads / job_id,
                max_voxels=self.settings.max_voxels,
                max_unzipped=8 * self.settings.max_upload_bytes,
            )
        except DataError as exc:
            status = 415 if "not a NRRD, NIfTI" in str(exc) else 400
            raise HTTPException(status, str(exc).replace(str(incoming), "the upload")) from None

    def describe(self, job_id: str) -> dict[str, Any]:
        job = self.job(job_id)
        summary = _summary(self.layout.case(job.id)) if job.status == "done" else None
        return {**job.public(), "report": summary}

    def download(self, job_id: str, kind: str) -> FileResponse:
        job = self.job(job_id)
        case = self.layout.case(job.id)
        if kind not in DOWNLOADS or job.status != "done":
            raise HTTPException(404, "no such file for this case")
        outputs = json.loads((case / "report.json").read_text())["outputs"]
        rel = {"stl": outputs["mesh"], "report": "report.json"}.get(kind) or outputs.get(kind)
        if rel is None:
            raise HTTPException(404, f"this case has no {kind} file (DICOM files are written for DICOM input only)")
        path = case / rel
        return FileResponse(path, filename=f"{job.id}-{path.name}", media_type="application/octet-stream")

    def view(self, job_id: str) -> Response:
        job = self.job(job_id)
        page = self.layout.case(job.id) / "view.html"
        if job.status != "done" or not page.is_file():
            raise HTTPException(404, "this case has no 3-D view (not finished)")
        html = page.read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Content-Security-Policy": view_csp(html)})

    def delete(self, job_id: str) -> dict[str, str]:
        job = self.job(job_id)
        if not self.store.delete(job.id):
            raise HTTPException(409, "the case is running; delete it when it has finished")
        shutil.rmtree(self.layout.case(job.id), ignore_errors=True)
        self.layout.upload(job).unlink(missing_ok=True)
        return {"deleted": job.id}


def _add_page_routes(app: FastAPI, settings: ServeSettings) -> None:
    """The page, its script and style, the health check and the sign-in: what answers without a token."""

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(_page_file("index.html"), headers={"Content-Security-Policy": PAGE_CSP})

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name not in ("app.js", "style.css"):
            raise HTTPException(404, "not found")
        return Response(_page_file(name), media_type=_MEDIA[Path(name).suffix])

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__, "token_required": bool(settings.token)}

    @app.post("/api/session")
    def session(body: dict[str, str]) -> JSONResponse:
        """Exchange the token for a cookie (HttpOnly, SameSite=Strict), so that views and downloads carry it."""
        if not settings.token:
            return JSONResponse({"ok": True})
        if not token_matches(body.get("token"), settings.token):
            raise HTTPException(401, "wrong token")
        response = JSONResponse({"ok": True})
        response.set_cookie(COOKIE, settings.token, httponly=True, samesite="strict")
        return response


def create_app(
    settings: ServeSettings,
    store: JobStore,
    layout: DataLayout,
    wake: Callable[[], None],
    on_stop: Callable[[], None] | None = None,
) -> FastAPI:
    """The service's application over ``store`` and ``layout``; ``wake`` tells the workers a job was queued,
    ``on_stop`` runs when the server shuts down cleanly (before uvicorn hands a caught signal back)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_stop is not None:
            on_stop()

    app = FastAPI(
        title="pointforge serve",
        version=__version__,
        summary="Cranial implant design from a defective skull",
        lifespan=lifespan,
    )
    app.middleware("http")(guard(settings))
    cases = _Cases(settings, store, layout, wake)

    _add_page_routes(app, settings)

    @app.get("/api/cases")
    def list_cases() -> list[dict[str, Any]]:
        return [job.public() for job in store.all()]

    @app.post("/api/cases", status_code=201)
    async def upload(request: Request, name: str | None = Query(None, description="a label (the file's name)")):
        """The file is the request body: NRRD, NIfTI (.nii/.nii.gz) or a zip of one CT DICOM series."""
        return await cases.receive(request, name)

    @app.get("/api/cases/{job_id}")
    def get_case(job_id: str) -> dict[str, Any]:
        return cases.describe(job_id)

    @app.delete("/api/cases/{job_id}")
    def delete_case(job_id: str) -> dict[str, str]:
        return cases.delete(job_id)

    @app.get("/api/cases/{job_id}/files/{kind}")
    def download(job_id: str, kind: str) -> FileResponse:
        return cases.download(job_id, kind)

    @app.get("/cases/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        if not layout.plotly_js.is_file():
            raise HTTPException(404, "not found")
        return FileResponse(layout.plotly_js, media_type="text/javascript")

    @app.get("/cases/{job_id}/view.html", include_in_schema=False)
    def view(job_id: str) -> Response:
        return cases.view(job_id)

    return app

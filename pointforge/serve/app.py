"""The FastAPI application: the page, the upload, the queue and the cases, every one an API call.

Routes (the OpenAPI schema is at ``/openapi.json``, browsable at ``/docs``):

* ``GET /`` the page; ``GET /static/app.js``, ``/static/style.css`` its script and style;
* ``POST /api/session`` ``{"token": ...}`` sets the token cookie the page uses;
* ``POST /api/cases?name=LABEL`` the file as the request body (``curl --data-binary @skull.nrrd``):
  checked, stored, queued; 201 with the job, or 400/413/415 with one line in ``detail``;
* ``GET /api/cases`` every job, newest first; ``GET /api/cases/{id}`` one job and its report's summary;
* ``GET /api/cases/{id}/files/{kind}`` a download (``implant``, ``uncertainty``, ``completed_skull``,
  ``report``; for a CT series in, ``seg`` and ``stl_dicom``); ``DELETE /api/cases/{id}`` removes a case that is not running;
* ``POST /api/cases/{id}/printable`` makes the print-ready STL of the vote or one proposal at a minimum
  thickness and margin, ``GET /api/cases/{id}/printable.stl`` downloads it (for a CT series in, also
  ``printable.dcm``: the same mesh as Encapsulated STL); ``GET /api/audit`` the audit log;
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
from pointforge.errors import DataError, UserError
from pointforge.implant.printable import PrintOptions, write_printable
from pointforge.serve.audit import AuditLog
from pointforge.serve.security import COOKIE, PAGE_CSP, address, guard, view_csp
from pointforge.serve.settings import ServeSettings
from pointforge.serve.store import Job, JobStore, is_job_id, new_job_id
from pointforge.serve.tokens import TokenStore
from pointforge.serve.uploads import check_upload
from pointforge.serve.worker import DataLayout, keep_within, recount

__all__ = ["create_app", "DOWNLOADS"]

DOWNLOADS = {"implant", "uncertainty", "completed_skull", "report", "seg", "stl_dicom"}
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
    summary = {
        key: report.get(key) for key in ("implant", "mesh", "agreement", "timings_s", "parameters", "notes", "dicom")
    }
    return {**summary, "proposals": len(report.get("outputs", {}).get("proposals", []))}


class _Cases:
    """The handlers that touch the store and the data folder."""

    def __init__(
        self, settings: ServeSettings, store: JobStore, layout: DataLayout, wake: Callable[[], None], audit: AuditLog
    ):
        self.settings, self.store, self.layout, self.wake, self.audit = settings, store, layout, wake, audit

    def log(self, request: Request, action: str, case: str | None = None, detail: str = "") -> None:
        person = request.state.person
        self.audit.record(action, person.name if person else None, address(request), case, detail)

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
        rel = "report.json" if kind == "report" else outputs.get(kind)
        if rel is None:
            raise HTTPException(404, f"this case has no {kind} file (DICOM files are written for DICOM input only)")
        path = case / rel
        return FileResponse(path, filename=f"{job.id}-{path.name}", media_type="application/octet-stream")

    def printable(self, job_id: str, options: PrintOptions) -> tuple[Path, dict]:
        """The case's STL for ``options`` (made on first asking, kept in the case folder) and its measurements."""
        job = self.job(job_id)
        if job.status != "done":
            raise HTTPException(404, "the case is not done; an STL can be made once it is")
        try:
            made = write_printable(self.layout.case(job.id), self.layout.upload(job), options)
        except UserError as exc:
            raise HTTPException(400, str(exc)) from None
        recount(self.store, self.layout, job)
        keep_within(self.store, self.layout, self.settings.max_disk_bytes, spare=job.id)
        return made

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


def _print_options(choice: str, min_thickness_mm: float, margin_mm: float) -> PrintOptions:
    try:
        return PrintOptions(choice=choice, min_thickness_mm=min_thickness_mm, margin_mm=margin_mm)
    except UserError as exc:
        raise HTTPException(400, str(exc)) from None


def _printable_name(job: Job, options: PrintOptions, suffix: str) -> str:
    """A print-ready file's download name: the case's label, its id and the choice."""
    return f"{Path(job.name).name.split('.')[0] or 'case'}-{job.id}-{options.slug()}{suffix}"


def _add_page_routes(app: FastAPI, settings: ServeSettings, tokens: TokenStore, audit: AuditLog) -> None:
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
        return {"ok": True, "version": __version__, "token_required": tokens.any_live()}

    @app.post("/api/session")
    def session(request: Request, body: dict[str, str]) -> JSONResponse:
        """Exchange a token for a cookie (HttpOnly, SameSite=Strict), so that views and downloads carry it."""
        if not tokens.any_live():
            return JSONResponse({"ok": True})
        person = tokens.find(body.get("token"))
        if person is None or person.revoked:
            audit.record(
                "sign-in-failed", person.name if person else None, address(request), detail="revoked" if person else ""
            )
            raise HTTPException(401, "wrong or revoked token")
        audit.record("sign-in", person.name, address(request))
        response = JSONResponse({"ok": True, "name": person.name})
        response.set_cookie(COOKIE, str(body["token"]), httponly=True, samesite="strict")
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
    tokens, audit = TokenStore(layout.root), AuditLog(layout.audit)
    app.middleware("http")(guard(settings, tokens, audit))
    cases = _Cases(settings, store, layout, wake, audit)

    _add_page_routes(app, settings, tokens, audit)
    _add_case_routes(app, cases, layout)

    @app.get("/api/audit")
    def audit_log(request: Request) -> FileResponse:
        """The audit log (JSON lines), for an admin token only."""
        person = request.state.person
        if person is None or not person.admin:
            raise HTTPException(403, "the audit log is for admin tokens (pointforge serve token add NAME --admin)")
        cases.log(request, "audit-download")
        return FileResponse(layout.audit, filename="audit.jsonl", media_type="application/x-ndjson")

    return app


def _add_case_routes(app: FastAPI, cases: _Cases, layout: DataLayout) -> None:
    store = cases.store

    @app.get("/api/cases")
    def list_cases() -> list[dict[str, Any]]:
        return [job.public() for job in store.all()]

    @app.post("/api/cases", status_code=201)
    async def upload(request: Request, name: str | None = Query(None, description="a label (the file's name)")):
        """The file is the request body: NRRD, NIfTI (.nii/.nii.gz) or a zip of one CT DICOM series."""
        response = await cases.receive(request, name)
        cases.log(request, "upload", json.loads(bytes(response.body))["id"])
        return response

    @app.get("/api/cases/{job_id}")
    def get_case(job_id: str) -> dict[str, Any]:
        return cases.describe(job_id)

    @app.delete("/api/cases/{job_id}")
    def delete_case(request: Request, job_id: str) -> dict[str, str]:
        deleted = cases.delete(job_id)
        cases.log(request, "delete", job_id)
        return deleted

    @app.get("/api/cases/{job_id}/files/{kind}")
    def download(request: Request, job_id: str, kind: str) -> FileResponse:
        response = cases.download(job_id, kind)
        cases.log(request, "download", job_id, kind)
        return response

    @app.post("/api/cases/{job_id}/printable")
    async def make_printable(
        request: Request, job_id: str, choice: str = "vote", min_thickness_mm: float = 0.0, margin_mm: float = 0.0
    ) -> dict[str, Any]:
        """Make the STL of one proposal or the vote, at least ``min_thickness_mm`` thick with a ``margin_mm``
        flange; answers what was measured on it and where to download it."""
        options = _print_options(choice, min_thickness_mm, margin_mm)
        _, measured = await run_in_threadpool(cases.printable, job_id, options)
        cases.log(request, "print", job_id, options.slug())
        query = f"choice={choice}&min_thickness_mm={min_thickness_mm:g}&margin_mm={margin_mm:g}"
        links = {"download": f"/api/cases/{job_id}/printable.stl?{query}"}
        if "stl_dicom" in measured:  # a CT series in: the same mesh as Encapsulated STL too
            links["download_dicom"] = f"/api/cases/{job_id}/printable.dcm?{query}"
        return {**{k: v for k, v in measured.items() if k != "stl_dicom"}, **links}

    @app.get("/api/cases/{job_id}/printable.stl")
    async def download_printable(
        request: Request, job_id: str, choice: str = "vote", min_thickness_mm: float = 0.0, margin_mm: float = 0.0
    ) -> FileResponse:
        options = _print_options(choice, min_thickness_mm, margin_mm)
        stl, _ = await run_in_threadpool(cases.printable, job_id, options)
        cases.log(request, "download", job_id, f"stl {options.slug()}")
        return FileResponse(stl, filename=_printable_name(cases.job(job_id), options, ".stl"), media_type="model/stl")

    @app.get("/api/cases/{job_id}/printable.dcm")
    async def download_printable_dicom(
        request: Request, job_id: str, choice: str = "vote", min_thickness_mm: float = 0.0, margin_mm: float = 0.0
    ) -> FileResponse:
        """For a CT series in: the print-ready STL as Encapsulated STL, in the series' Frame of Reference."""
        options = _print_options(choice, min_thickness_mm, margin_mm)
        stl, measured = await run_in_threadpool(cases.printable, job_id, options)
        if "stl_dicom" not in measured:
            raise HTTPException(404, "this case has no DICOM STL (DICOM files are written for DICOM input only)")
        cases.log(request, "download", job_id, f"stl_dicom {options.slug()}")
        name = _printable_name(cases.job(job_id), options, ".dcm")
        return FileResponse(stl.parent / measured["stl_dicom"], filename=name, media_type="application/dicom")

    @app.get("/cases/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        if not layout.plotly_js.is_file():
            raise HTTPException(404, "not found")
        return FileResponse(layout.plotly_js, media_type="text/javascript")

    @app.get("/cases/{job_id}/view.html", include_in_schema=False)
    def view(request: Request, job_id: str) -> Response:
        page = cases.view(job_id)
        cases.log(request, "view", job_id)
        return page

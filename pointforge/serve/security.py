"""The checks every request passes, and the headers every response carries.

* **token**: when the data folder has named tokens (:mod:`~pointforge.serve.tokens`),
  every API and case request must carry a live one (``Authorization: Bearer <token>``,
  or the ``pointforge_token`` cookie the page gets from ``POST /api/session``),
  looked up by its hash; the person it names is the one the audit log records.
  A missing, unknown or revoked token is refused and logged. The page itself and
  its script load without one, so a user can type it in.
* **origin**: a request whose ``Origin`` is not the service's own, or that a
  browser marks ``Sec-Fetch-Site: cross-site``, is refused (403); no CORS
  header is ever sent, so no other site can read an answer either.
* **host**: on a loopback address only ``localhost``, ``127.0.0.1`` and
  ``[::1]`` are accepted as ``Host``, which stops DNS-rebinding pages; behind
  a reverse proxy, ``--public-url`` adds the one address browsers use (as
  ``Host`` and as ``Origin``).
* **headers**: a content security policy on every page, ``nosniff``, no
  referrer, no framing by other sites, no caching of API answers.
"""

from __future__ import annotations

import hashlib
import re
from base64 import b64encode
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pointforge.serve.audit import AuditLog
from pointforge.serve.settings import ServeSettings, is_loopback
from pointforge.serve.tokens import TokenStore

__all__ = ["COOKIE", "PAGE_CSP", "view_csp", "guard", "presented_token", "address"]

COOKIE = "pointforge_token"
PUBLIC_PATHS = ("/", "/static/app.js", "/static/style.css", "/api/session", "/api/health")
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.S)


def view_csp(html: str) -> str:
    """The policy for a case's view.html: its own inline scripts (by hash) and plotly.js from this service.

    plotly.js sets styles at run time, hence inline styles; no script may be evaluated from a string."""
    hashes = " ".join(
        f"'sha256-{b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; worker-src blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'self'"
    )


def address(request: Request) -> str | None:
    return request.client.host if request.client else None


def presented_token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.cookies.get(COOKIE)


def _refusal(status: int, detail: str) -> Response:
    return JSONResponse({"detail": detail}, status_code=status)


def _refused(request: Request, settings: ServeSettings, tokens: TokenStore, audit: AuditLog) -> Response | None:
    host = request.headers.get("host", "")
    public = settings.public_origin
    if is_loopback(settings.host) and not (public is not None and host == public[1]):
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if name not in ("localhost", "127.0.0.1", "[::1]"):
            return _refusal(421, f"host {host[:80]!r} is not this service's address")
    origin = request.headers.get("origin")
    own = {f"{request.url.scheme}://{host}", *([public[0]] if public else [])}
    if (origin is not None and origin not in own) or request.headers.get("sec-fetch-site") == "cross-site":
        return _refusal(403, "cross-origin requests are refused")
    request.state.person = None
    if request.url.path not in PUBLIC_PATHS and tokens.any_live():
        person = tokens.find(presented_token(request))
        if person is None or person.revoked:
            detail = "no token" if presented_token(request) is None else ("revoked" if person else "unknown token")
            audit.record("refused", person.name if person else None, address(request), detail=detail)
            return _refusal(
                401, "a valid token is required: send 'Authorization: Bearer <token>' or sign in on the page"
            )
        request.state.person = person
    return None


def guard(
    settings: ServeSettings, tokens: TokenStore, audit: AuditLog
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """The HTTP middleware: the checks above, then the common headers on whatever answers."""

    async def middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = _refused(request, settings, tokens, audit) or await call_next(request)
        response.headers.setdefault("Content-Security-Policy", PAGE_CSP)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cross-Origin-Resource-Policy"] = "same-origin"
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    return middleware

"""Who did what: an append-only audit log beside the jobs database, one JSON object a line.

Each line holds the time (UTC, ISO 8601), the person (the name of the token
used; null when the service has no tokens), the action (``sign-in``,
``sign-in-failed``, ``refused``, ``upload``, ``view``, ``download``,
``print``, ``delete``, ``audit-download``), the case id where there is one, a
detail (which file, which token problem) and the source address (the TCP
peer: behind a proxy, the proxy). In the spirit of IHE ATNA it holds no
patient data: a case appears by its id only, never by its file name.
Lines are appended with ``O_APPEND`` and synced before the request answers.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["AuditLog"]


class AuditLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def record(
        self, action: str, person: str | None, address: str | None, case: str | None = None, detail: str = ""
    ) -> None:
        entry = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "person": person,
            "action": action,
            "case": case,
            "detail": detail,
            "address": address,
        }
        line = (json.dumps(entry) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

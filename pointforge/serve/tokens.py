"""Named tokens, one per person, kept hashed in ``tokens.sqlite3`` beside the jobs database.

A token is 32 random bytes (URL-safe text) shown once when it is made; only
its SHA-256 is stored (a random secret of that length needs no slow hash).
``pointforge serve token add|revoke|list`` manages them, also while the
service runs: every request looks its token up, so a revoked one is refused
at once. An admin token may also download the audit log.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pointforge.errors import UserError

__all__ = ["Person", "TokenStore", "TOKENS_FILE"]

TOKENS_FILE = "tokens.sqlite3"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    name TEXT PRIMARY KEY, hash TEXT UNIQUE NOT NULL, admin INTEGER NOT NULL, created REAL NOT NULL, revoked REAL
)
"""


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Person:
    name: str
    admin: bool
    revoked: bool


class TokenStore:
    def __init__(self, data_dir: Path):
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(Path(data_dir) / TOKENS_FILE, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, name: str, *, admin: bool = False) -> str:
        """A new token for ``name`` (returned once; only its hash is kept)."""
        if not _NAME.match(name):
            raise UserError(f"token names are letters, digits and . _ @ - (at most 64), got {name!r}")
        token = secrets.token_urlsafe(32)
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO tokens (name, hash, admin, created) VALUES (?, ?, ?, ?)",
                    (name, _hash(token), int(admin), time.time()),
                )
            except sqlite3.IntegrityError:
                raise UserError(f"a token named {name!r} exists already; revoke it or choose another name") from None
        return token

    def revoke(self, name: str) -> None:
        with self._lock:
            changed = self._db.execute(
                "UPDATE tokens SET revoked = ? WHERE name = ? AND revoked IS NULL", (time.time(), name)
            ).rowcount
        if changed != 1:
            raise UserError(f"no live token named {name!r}; see `pointforge serve token list`")

    def find(self, token: str | None) -> Person | None:
        """Whose token this is (revoked ones too, so that the refusal names them); None if nobody's."""
        if not token:
            return None
        with self._lock:
            row = self._db.execute("SELECT name, admin, revoked FROM tokens WHERE hash = ?", (_hash(token),)).fetchone()
        return Person(row[0], bool(row[1]), row[2] is not None) if row else None

    def any_live(self) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM tokens WHERE revoked IS NULL LIMIT 1").fetchone() is not None

    def listing(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT name, admin, created, revoked FROM tokens ORDER BY created").fetchall()
        return [{"name": n, "admin": bool(a), "created": c, "revoked": r} for n, a, c, r in rows]

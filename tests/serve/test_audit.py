"""Who did what: named tokens (hashed, revocable) and the audit log, through the API in-process."""

from __future__ import annotations

import json

from pointforge.data.volumes import write_volume
from pointforge.serve.tokens import TOKENS_FILE, TokenStore
from tests.helpers import shell_mask
from tests.serve.test_security import client_for


def entries(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]


def test_each_action_is_logged_once_under_its_person_and_a_revoked_token_is_refused(tmp_path):
    tokens = TokenStore(tmp_path)
    alice, admin = tokens.add("alice"), tokens.add("root", admin=True)
    assert alice not in (tmp_path / TOKENS_FILE).read_bytes().decode("latin-1")  # stored hashed
    client, _ = client_for(tmp_path)
    skull = write_volume(tmp_path / "skull.nrrd", shell_mask((24, 24, 24), radii=(9, 8, 7))).read_bytes()
    assert client.post("/api/session", json={"token": "wrong"}).status_code == 401
    assert client.post("/api/session", json={"token": alice}).status_code == 200
    made = client.post("/api/cases", params={"name": "Doe^John.nrrd"}, content=skull)
    case = made.json()["id"]
    assert client.delete(f"/api/cases/{case}").status_code == 200
    assert client.get("/api/audit").status_code == 403  # alice is no admin
    tokens.revoke("alice")
    assert client.get("/api/cases").status_code == 401
    log = client.get("/api/audit", headers={"Authorization": f"Bearer {admin}"})
    assert log.status_code == 200
    got = [(e["person"], e["action"], e["case"]) for e in entries(tmp_path)]
    assert got == [
        (None, "sign-in-failed", None),
        ("alice", "sign-in", None),
        ("alice", "upload", case),
        ("alice", "delete", case),
        ("alice", "refused", None),
        ("root", "audit-download", None),
    ]
    assert all(e["address"] for e in entries(tmp_path)) and "Doe" not in (tmp_path / "audit.jsonl").read_text()

"""Secure by default: token, origin, host, size limit, ids instead of paths, no listing, CSP.

The application runs in-process (FastAPI's TestClient) over a real store and
data folder, without workers: these checks happen before any job runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pointforge.data.volumes import write_volume
from pointforge.errors import UserError
from pointforge.serve.app import create_app
from pointforge.serve.security import COOKIE
from pointforge.serve.settings import ServeSettings
from pointforge.serve.store import JobStore
from pointforge.serve.tokens import TokenStore
from pointforge.serve.worker import DataLayout
from tests.helpers import shell_mask


def client_for(tmp_path, **settings) -> tuple[TestClient, JobStore]:
    config = ServeSettings(data_dir=tmp_path, **settings)
    layout = DataLayout(tmp_path)
    store = JobStore(layout.db)
    app = create_app(config, store, layout, wake=lambda: None)
    return TestClient(app, base_url="http://127.0.0.1:8000"), store


@pytest.fixture
def skull_bytes(tmp_path) -> bytes:
    return write_volume(tmp_path / "skull.nrrd", shell_mask((24, 24, 24), radii=(9, 8, 7))).read_bytes()


def test_listening_beyond_loopback_needs_named_tokens():
    ServeSettings(data_dir=".", host="127.0.0.1").check_reach(False)
    with pytest.raises(UserError, match="token add NAME"):
        ServeSettings(data_dir=".", host="0.0.0.0").check_reach(False)
    ServeSettings(data_dir=".", host="0.0.0.0").check_reach(True)


def test_no_token_or_a_wrong_token_is_refused_and_the_right_one_passes(tmp_path, skull_bytes):
    TOKEN = TokenStore(tmp_path).add("alice")
    client, store = client_for(tmp_path, host="0.0.0.0")
    client.headers["host"] = "implants.example.org"  # not loopback: any host name is allowed
    assert client.get("/api/cases").status_code == 401
    assert client.post("/api/cases", content=skull_bytes).status_code == 401
    wrong = {"Authorization": "Bearer " + TOKEN[:-1] + "X"}
    assert client.get("/api/cases", headers=wrong).status_code == 401
    assert client.post("/api/session", json={"token": "nope"}).status_code == 401
    assert store.all() == []
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/api/cases", headers=good).json() == []
    assert client.get("/").status_code == 200  # the page loads, so a user can type the token
    signed = client.post("/api/session", json={"token": TOKEN})
    assert signed.status_code == 200 and "httponly" in signed.headers["set-cookie"].lower()
    assert client.cookies.get(COOKIE) and client.get("/api/cases").status_code == 200


def test_cross_origin_requests_and_foreign_host_names_are_refused(tmp_path, skull_bytes):
    client, store = client_for(tmp_path)
    evil = {"Origin": "http://evil.example"}
    assert client.post("/api/cases", content=skull_bytes, headers=evil).status_code == 403
    assert client.get("/api/cases", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.get("/api/cases", headers={"Host": "rebound.example:8000"}).status_code == 421
    assert store.all() == []
    same = client.post("/api/cases", content=skull_bytes, headers={"Origin": "http://127.0.0.1:8000"})
    assert same.status_code == 201 and "access-control-allow-origin" not in same.headers


def test_an_oversized_upload_is_refused_and_leaves_nothing(tmp_path):
    client, store = client_for(tmp_path, max_upload_mb=0.01)
    answer = client.post("/api/cases", content=bytes(20_000))
    assert answer.status_code == 413 and "limit" in answer.json()["detail"]

    def chunks():  # no Content-Length: counted while it streams
        for _ in range(10):
            yield bytes(4096)

    assert client.post("/api/cases", content=chunks()).status_code == 413
    assert (
        store.all() == [] and not any((tmp_path / "incoming").iterdir()) and not any((tmp_path / "uploads").iterdir())
    )


def test_a_refused_upload_says_why_in_one_line(tmp_path):
    client, store = client_for(tmp_path)
    answer = client.post("/api/cases?name=skull.nrrd", content=b"\x89PNG\r\n\x1a\n" + bytes(100))
    assert answer.status_code == 415 and "PNG" in answer.json()["detail"] and "\n" not in answer.json()["detail"]
    corrupt = client.post(
        "/api/cases", content=b"NRRD0004\ntype: uint8\ndimension: 3\nsizes: 9 9 9\nencoding: gzip\n\nxx"
    )
    assert corrupt.status_code == 400 and "\n" not in corrupt.json()["detail"]
    assert store.all() == []


def test_client_names_never_become_paths(tmp_path, skull_bytes):
    client, store = client_for(tmp_path)
    made = client.post("/api/cases", params={"name": "../../etc/passwd"}, content=skull_bytes).json()
    job = store.get(made["id"])
    assert job.name == "passwd" and job.input == f"{job.id}.nrrd"
    assert [p.name for p in (tmp_path / "uploads").iterdir()] == [f"{job.id}.nrrd"]
    for path in (
        "/api/cases/..%2F..%2Fjobs.sqlite3",
        "/api/cases/../jobs.sqlite3",
        f"/api/cases/{job.id}/files/..%2F..%2Fjobs.sqlite3",
        f"/api/cases/{job.id}/files/report",  # not finished yet
        "/cases/%2Fetc%2Fpasswd/view.html",
    ):
        assert client.get(path).status_code == 404, path


def test_no_directory_is_listed(tmp_path):
    client, _ = client_for(tmp_path)
    for path in ("/cases/", "/cases", "/static/", "/uploads/", "/data/", "/static/..%2Fapp.py", "/static/index.html"):
        answer = client.get(path)
        assert answer.status_code in (404, 405), path
        assert "jobs.sqlite3" not in answer.text and "<li>" not in answer.text


def test_the_page_carries_a_content_security_policy_and_the_api_its_schema(tmp_path):
    client, _ = client_for(tmp_path)
    page = client.get("/")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    assert "<script" in page.text and "<script>" not in page.text  # no inline script on the page itself
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/api/cases", "/api/cases/{job_id}", "/api/cases/{job_id}/files/{kind}"} <= set(paths)


def test_deleting_removes_the_case_but_never_a_running_one(tmp_path, skull_bytes):
    client, store = client_for(tmp_path)
    first = client.post("/api/cases", content=skull_bytes).json()["id"]
    second = client.post("/api/cases", content=skull_bytes).json()["id"]
    assert store.claim().id == first
    assert client.delete(f"/api/cases/{first}").status_code == 409
    assert client.delete(f"/api/cases/{second}").json() == {"deleted": second}
    assert [j["id"] for j in client.get("/api/cases").json()] == [first]
    assert not (tmp_path / "uploads" / f"{second}.nrrd").exists()
    assert client.get(f"/api/cases/{second}").status_code == 404


def test_the_shape_of_an_accepted_upload_is_reported(tmp_path):
    client, _ = client_for(tmp_path)
    mask = np.zeros((10, 12, 14), np.uint8)
    mask[2:8, 2:8, 2:8] = 1
    body = write_volume(tmp_path / "m.nrrd", mask).read_bytes()
    made = client.post("/api/cases", content=body)
    assert made.status_code == 201 and made.json()["shape"] == [10, 12, 14] and made.json()["status"] == "queued"


def test_the_command_refuses_a_network_address_without_a_token_in_one_line(tmp_path):
    from tests.helpers import run_cli_process

    ck = tmp_path / "none.pt"
    code, out, err = run_cli_process(
        "serve", "--pcdiff", ck, "--voxelizer", ck, "--host", "0.0.0.0", "--data-dir", tmp_path / "d", timeout=120
    )
    assert code == 2 and "token add NAME" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "d").exists()


def test_a_ct_series_zip_is_accepted_through_the_api_and_queued_as_the_zip(tmp_path):
    from tests.dicom_series import ct_series_zip

    client, store = client_for(tmp_path)
    skull = shell_mask((24, 24, 12), radii=(9, 8, 5), thickness=2.0)
    made = client.post("/api/cases", params={"name": "ct.zip"}, content=ct_series_zip(np.where(skull, 1000.0, 0.0)))
    assert made.status_code == 201 and made.json()["kind"] == "dicom-zip", made.text
    assert store.get(made.json()["id"]).input == f"{made.json()['id']}.zip"  # generate writes DICOM from it
    assert not any((tmp_path / "incoming").iterdir())


def test_behind_a_proxy_the_public_address_is_the_one_more_host_and_origin_accepted(tmp_path, skull_bytes):
    TOKEN = TokenStore(tmp_path).add("alice")
    client, store = client_for(tmp_path, public_url="https://implants.example.org")
    proxied = {"Host": "implants.example.org", "Authorization": f"Bearer {TOKEN}"}
    made = client.post("/api/cases", content=skull_bytes, headers={**proxied, "Origin": "https://implants.example.org"})
    assert made.status_code == 201, made.text
    assert client.get("/api/cases", headers={**proxied, "Host": "other.example.org"}).status_code == 421
    foreign = {**proxied, "Origin": "https://evil.example"}
    assert client.post("/api/cases", content=skull_bytes, headers=foreign).status_code == 403
    with pytest.raises(UserError, match="--public-url must be like"):
        ServeSettings(data_dir=".", public_url="implants.example.org/x").validate()
    with pytest.raises(UserError, match="token add NAME"):
        ServeSettings(data_dir=".", public_url="https://implants.example.org").check_reach(False)

"""Who did what: named tokens (hashed, revocable) and the audit log, through the API in-process."""

from __future__ import annotations

import io
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


def a_done_case(store, layout, tmp_path, name: str, size: int) -> str:
    """A finished case as the worker leaves it, reduced to what the view and the printable STL read: the
    thin dome of tests/implant/test_printable.py as the vote and its one proposal, the rest of the skull
    as the upload."""
    from pointforge.serve.store import new_job_id
    from tests.implant.test_printable import a_case_folder, thin_dome

    job_id = new_job_id()
    job = store.add(job_id, name, f"{job_id}.nrrd", "nrrd")
    store.claim()
    made, defective = a_case_folder(tmp_path / job.id, thin_dome())
    made.rename(layout.case(job.id))
    defective.rename(layout.upload(job))
    (layout.case(job.id) / "view.html").write_text("<html><body>view</body></html>")
    store.finish(job.id, 1.0, size)
    return job.id


def test_a_view_and_a_printable_download_are_logged_and_the_stl_counts_towards_the_disk_bound(tmp_path):
    from pointforge.serve.worker import DataLayout

    alice = TokenStore(tmp_path).add("alice")
    client, store = client_for(tmp_path, max_disk_gb=1e-9)  # a few bytes: any growth evicts what it can
    client.headers["Authorization"] = f"Bearer {alice}"
    layout = DataLayout(tmp_path)
    older, case = (a_done_case(store, layout, tmp_path / "made", n, size=10) for n in ("older", "Doe Jane.nrrd"))
    assert client.get(f"/cases/{case}/view.html").status_code == 200
    asked = {"choice": "1", "min_thickness_mm": 3}
    made = client.post(f"/api/cases/{case}/printable", params=asked)
    assert made.status_code == 200 and made.json()["measured_min_thickness_mm"] >= 3.0, made.text
    stl = client.get(made.json()["download"])
    assert stl.status_code == 200 and len(stl.content) > 1000
    assert stl.headers["content-disposition"].endswith(f"Doe%20Jane-{case}-proposal1-t3mm-m0mm.stl")  # case, choice
    assert client.post(f"/api/cases/{case}/printable", params={"choice": "2"}).status_code == 400
    got = [(e["person"], e["action"], e["case"], e["detail"]) for e in entries(tmp_path)]
    assert got == [
        ("alice", "view", case, ""),
        ("alice", "print", case, "proposal1-t3mm-m0mm"),
        ("alice", "download", case, "stl proposal1-t3mm-m0mm"),
    ]
    assert "Doe" not in (tmp_path / "audit.jsonl").read_text()
    # The STL made on request is counted: the case grew past the bound, the older case was evicted for it,
    # and the case itself was spared for the download that follows.
    assert store.get(case).bytes > len(stl.content) and store.get(case).status == "done"
    assert store.get(older).status == "evicted" and not layout.case(older).exists()


def test_a_ct_series_case_offers_its_print_ready_stl_as_dicom_too_and_logs_that_download(tmp_path):
    """A case uploaded as a zipped CT series: the print-ready STL is made from the series kept as the upload
    (the skull read as `generate` read it), and offered as Encapsulated STL in the series' Frame of Reference."""
    import numpy as np
    import pydicom

    from pointforge.data.dicom import read_ct_series
    from pointforge.serve.store import new_job_id
    from pointforge.serve.worker import DataLayout
    from tests.dicom_series import ct_series_zip
    from tests.implant.test_printable import a_case_folder, thin_dome

    alice = TokenStore(tmp_path).add("alice")
    client, store = client_for(tmp_path)
    client.headers["Authorization"] = f"Bearer {alice}"
    layout = DataLayout(tmp_path)
    skull, implant = thin_dome()
    job_id = new_job_id()
    job = store.add(job_id, "head.zip", f"{job_id}.zip", "dicom-zip")
    series_zip = layout.uploads / f"{job.id}.zip"
    series_zip.write_bytes(ct_series_zip(np.where(skull.data, 1200.0, 20.0), spacing=(2.0, 2.0, 2.0)))
    series = read_ct_series(series_zip)
    made, _ = a_case_folder(tmp_path / "made", (series.skull, implant))
    made.rename(layout.case(job.id))
    store.claim()
    store.finish(job.id, 1.0, 10)
    asked = {"choice": "1", "min_thickness_mm": 3}
    answer = client.post(f"/api/cases/{job.id}/printable", params=asked)
    assert answer.status_code == 200, answer.text
    assert (
        answer.json()["download_dicom"] == f"/api/cases/{job.id}/printable.dcm?choice=1&min_thickness_mm=3&margin_mm=0"
    )
    got = client.get(answer.json()["download_dicom"])
    named = got.headers["content-disposition"]
    assert got.status_code == 200 and named.endswith(f'filename="head-{job.id}-proposal1-t3mm-m0mm.dcm"'), named
    ds = pydicom.dcmread(io.BytesIO(got.content))
    assert ds.FrameOfReferenceUID == series.frame_of_reference_uid and ds.Modality == "M3D"
    assert [(e["action"], e["detail"]) for e in entries(tmp_path)] == [
        ("print", "proposal1-t3mm-m0mm"),
        ("download", "stl_dicom proposal1-t3mm-m0mm"),
    ]
    mask_case = a_done_case(store, layout, tmp_path / "made-nrrd", "skull.nrrd", size=10)  # a mask in: no DICOM
    answer = client.post(f"/api/cases/{mask_case}/printable", params=asked)
    assert answer.status_code == 200 and "download_dicom" not in answer.json()
    assert client.get(f"/api/cases/{mask_case}/printable.dcm", params=asked).status_code == 404

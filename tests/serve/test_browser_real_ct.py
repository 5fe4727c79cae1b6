"""A real CT series through the service in a real browser: the Visible Human Female head, a defect cut into it.

Where ``POINTFORGE_REAL_CT`` names a folder holding ``female_head/`` (docs/serve.md says where to get it; never in
the repository) and chromium with chromedriver are installed, as a person would on the page with a named token:
sign in, upload the series as a zip, open the finished case, choose proposal 1 and a minimum thickness of 2 mm,
make the print-ready STL, download the DICOM SEG and the print-ready STL as Encapsulated STL; then the token is
revoked (``pointforge serve token revoke``) and refused. Read back with highdicom and pydicom: both files carry
the uploaded series' Frame of Reference UID and land on its bone (HU >= 300, from the uploaded slices' own pixels
and positions) within one voxel; the STL is the chosen proposal at the thickness asked (its title and file name,
the page's line, and its minimum thickness measured on the mesh as the printable tests measure it); every action
is in the audit log once, under the person's name.

Kept small without faking anything: the upload is the top 120 slices of the real series (vertex to above the
skull base, as a shorter scan range would give; full 512² slices, its own pixels, positions and UIDs), with a
``random_1`` defect of the project's own generator cut into the bone (set to 40 HU); the tests' tiny models
(tests/conftest.py) make the implant: this checks the path and the geometry, not the design.
"""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import trimesh

from pointforge.implant.thickness import min_wall_thickness
from tests.dicom_series import nearest_mm, seg_points
from tests.helpers import run_cli_process
from tests.serve.page import CHROMEDRIVER, CHROMIUM, NO_BROWSER, case_open_on_the_page, make_printable, wait_for

REAL = Path(os.environ.get("POINTFORGE_REAL_CT", "/nonexistent"))
SLICES = 120  # the top of the head: the cranial vault, without the mandible and spine
THICKNESS_MM = 2.0  # 3 mm is refused on this case: docs/serve.md, "What it does and does not claim"
CHOICE = "proposal1-t2mm-m0mm"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (REAL / "female_head").is_dir(),
        reason="set POINTFORGE_REAL_CT to a folder holding female_head/ (docs/serve.md) to run this",
    ),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=NO_BROWSER),
    pytest.mark.timeout(1800),  # a busy 2-core machine; the tiny models may be trained first
]


def defective_head_zip(source: Path, target: Path) -> tuple[str, np.ndarray]:
    """The top ``SLICES`` slices of the head with a random_1 defect cut (its bone set to 40 HU), zipped at
    ``target``; the series' Frame of Reference UID and the remaining bone's LPS positions (HU >= 300)."""
    import pydicom

    from pointforge.data.dicom import ct_series_from_bytes
    from pointforge.data.synthetic.defects import make_defect

    files = {}
    for path in sorted(source.iterdir()):
        header = pydicom.dcmread(path, stop_before_pixels=True)
        files[float(header.ImagePositionPatient[2])] = path
    kept = [files[z] for z in sorted(files)[-SLICES:]]
    series = ct_series_from_bytes(path.read_bytes() for path in kept)
    assert np.allclose(series.skull.spacing, 1.0) and series.skull.shape == (512, 512, SLICES)  # its own grid
    defect = make_defect(series.skull.data, "random_1", np.random.default_rng(0), series.skull.spacing)
    assert defect.any()
    by_uid = {str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID): p for p in kept}
    bone = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for k, header in enumerate(series.headers):
            ds = pydicom.dcmread(by_uid[str(header.SOPInstanceUID)])
            pixels = ds.pixel_array.copy()
            pixels[defect[:, :, k].T] = int((40 - float(ds.RescaleIntercept)) / float(ds.RescaleSlope))
            ds.PixelData = pixels.tobytes()
            buffer = io.BytesIO()
            ds.save_as(buffer)
            archive.writestr(f"female_head/slice{k:03d}.dcm", buffer.getvalue())
            rows, cols = np.nonzero(pixels * float(ds.RescaleSlope) + float(ds.RescaleIntercept) >= 300)
            bone.append(_patient_mm(ds, rows, cols))
    return series.frame_of_reference_uid, np.concatenate(bone)


def _patient_mm(ds, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The LPS positions of the pixels (``rows``, ``cols``) of the slice ``ds`` (DICOM PS3.3 C.7.6.2.1.1)."""
    orientation = np.asarray(ds.ImageOrientationPatient, float)
    row_mm, col_mm = (float(v) for v in ds.PixelSpacing)
    corner = np.asarray(ds.ImagePositionPatient, float)
    return corner + np.outer(cols * col_mm, orientation[:3]) + np.outer(rows * row_mm, orientation[3:])


def near(points: np.ndarray, bone: np.ndarray, reach_mm: float = 10.0) -> np.ndarray:
    """The bone within ``reach_mm`` of the box around ``points`` (a small tree to search)."""
    low, high = points.min(axis=0) - reach_mm, points.max(axis=0) + reach_mm
    return bone[np.all((bone >= low) & (bone <= high), axis=1)]


@pytest.fixture(scope="module")
def real_case(tiny_models, tmp_path_factory) -> dict:
    """One session on the page with the real series, as alice; then her token revoked and refused."""
    import httpx
    from selenium.webdriver.common.by import By

    pcdiff, voxelizer, _ = tiny_models
    tmp_path = tmp_path_factory.mktemp("real-ct-page")
    upload = tmp_path / "female_head_top.zip"
    frame, bone = defective_head_zip(REAL / "female_head", upload)
    with case_open_on_the_page(tmp_path, pcdiff, voxelizer, upload, timeout=900) as page:
        driver, downloads = page.driver, page.downloads
        wait_for(lambda: driver.find_element(By.ID, "case-checks").text, 30, "the reader's notes on the page")
        checks = driver.find_element(By.ID, "case-checks").text
        result = make_printable(driver, choice="1", thickness_mm=THICKNESS_MM, timeout=900)
        for kind in ("seg", "stl_dicom_printable"):
            before = set(downloads.glob("*.dcm"))
            driver.find_element(By.ID, f"download-{kind}").click()
            wait_for(lambda: set(downloads.glob("*.dcm")) - before, 120, f"the {kind} download")
            wait_for(lambda: not list(downloads.glob("*.crdownload")), 60, "the download to complete")
        page.close_browser()
        code, said, stderr = run_cli_process("serve", "token", "revoke", "alice", "--data-dir", tmp_path / "data")
        assert code == 0, stderr
        with httpx.Client(base_url=page.server.url, timeout=30) as client:
            refused = client.get("/api/cases", headers={"Authorization": f"Bearer {page.alice}"})
            signin = client.post("/api/session", json={"token": page.alice})
        audit = page.server.client.get("/api/audit", headers={"Authorization": f"Bearer {page.admin}"})
    return {
        "case": page.case,
        "frame": frame,
        "bone": bone,
        "checks": checks,
        "result": result,
        "files": {p.name: p for p in downloads.glob("*.dcm")},
        "refused": (refused.status_code, signin.status_code, signin.text),
        "audit": audit,
    }


def _one(files: dict[str, Path], ending: str) -> Path:
    found = [path for name, path in files.items() if name.endswith(ending)]
    assert len(found) == 1, f"expected one download named *{ending}, got {sorted(files)}"
    return found[0]


def test_the_page_lists_what_the_reader_did_with_the_real_series(real_case):
    checks = real_case["checks"]
    assert "Hounsfield units: stored value" in checks and "kept the largest connected piece" in checks, checks


def test_the_seg_reads_back_in_the_series_frame_on_its_bone(real_case):
    seg, points = seg_points(_one(real_case["files"], f"{real_case['case']}-implant_seg.dcm"))
    assert seg.FrameOfReferenceUID == real_case["frame"] and len(points) > 0
    gap = nearest_mm(near(points, real_case["bone"]), points).min()  # from the (fewer) bone voxels near it
    assert gap <= math.sqrt(3), f"the SEG lies {gap:.2f} mm from the series' bone, not within a voxel"


def test_the_encapsulated_stl_is_the_chosen_proposal_at_the_thickness_asked_on_the_bone(real_case):
    import pydicom

    path = _one(real_case["files"], f"-{real_case['case']}-{CHOICE}.dcm")  # named for the case and the choice
    ds = pydicom.dcmread(path)
    assert ds.SOPClassUID == pydicom.uid.EncapsulatedSTLStorage and ds.MIMETypeOfEncapsulatedDocument == "model/stl"
    assert ds.FrameOfReferenceUID == real_case["frame"] and CHOICE in ds.SeriesDescription
    stl = bytes(ds.EncapsulatedDocument)[: int(ds.EncapsulatedDocumentLength)]
    mesh = trimesh.load(io.BytesIO(stl), file_type="stl")
    assert mesh.is_watertight and len(mesh.faces) > 0
    result = real_case["result"]
    assert result.startswith("proposal 1: measured minimum thickness") and "(asked 2 mm, margin 0 mm)" in result
    shown_mm = float(result.split("measured minimum thickness ")[1].split(" mm")[0])
    measured_mm = min_wall_thickness(mesh, THICKNESS_MM / 6 + 1e-4, 1.5 * THICKNESS_MM)  # as the service reads it
    assert min(shown_mm, measured_mm) >= THICKNESS_MM, (result, measured_mm)
    gap = nearest_mm(near(mesh.vertices, real_case["bone"]), mesh.vertices).min()
    assert gap <= math.sqrt(3), f"the STL lies {gap:.2f} mm from the series' bone, not within a voxel"


def test_each_action_is_logged_once_under_the_person_and_the_revoked_token_is_refused(real_case):
    refused, signin, said = real_case["refused"]
    assert refused == 401 and signin == 401 and "revoked" in said
    audit, case = real_case["audit"], real_case["case"]
    assert audit.status_code == 200, audit.text
    logged = [json.loads(line) for line in audit.text.splitlines()]
    alices = [(e["action"], e["case"], e["detail"]) for e in logged if e["person"] == "alice"]
    assert alices == [
        ("sign-in", None, ""),
        ("upload", case, ""),
        ("view", case, ""),
        ("print", case, CHOICE),
        ("download", case, "seg"),
        ("download", case, f"stl_dicom {CHOICE}"),
        ("refused", None, "revoked"),
        ("sign-in-failed", None, "revoked"),
    ], alices

"""The page in a real browser: the distribution's headless Chromium, driven by Selenium through its chromedriver.

Against a real `pointforge serve` process on the tiny models, with named tokens:
sign in on the page, choose a file and upload it, wait until the case is listed
as done, open it, check that its 3-D view shows the skull in bone colour and the
implant in the agreement colours (the colour check of tests/implant/test_browser.py),
choose a proposal and a minimum thickness, make its print-ready STL, download it
through its link, check that it is watertight and at least that thick measured on
the mesh, and that each of these actions is in the audit log once, under the name
of the person who signed in. .ci/run installs chromium and chromium-driver; without
them this test skips and says why.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import trimesh
from matplotlib.image import imread

from pointforge.implant.thickness import min_wall_thickness
from tests.implant.test_browser import colour_fractions
from tests.serve.page import CHROMEDRIVER, CHROMIUM, NO_BROWSER, case_open_on_the_page, make_printable, wait_for

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=NO_BROWSER),
    pytest.mark.timeout(600),  # the tiny models may be trained first, in the session fixture
]


def check_the_view(driver, tmp_path: Path):
    from selenium.webdriver.common.by import By

    frame = wait_for(lambda: driver.find_element(By.ID, "view"), 10, "the 3-D view")
    driver.switch_to.frame(frame)
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "canvas"), 60, "plotly's WebGL canvas")
    driver.switch_to.default_content()
    time.sleep(3)  # plotly draws on the next animation frames
    driver.execute_script("arguments[0].scrollIntoView()", frame)
    png = frame.screenshot_as_png
    (tmp_path / "view.png").write_bytes(png)  # kept beside the test's files, to look at when it fails
    pixels = imread(io.BytesIO(png), format="png")[..., :3].astype(np.float64)
    height, width = pixels.shape[:2]
    bone, implant = colour_fractions(pixels[height // 8 : -height // 8, width // 4 : -width // 4])
    print(f"bone {bone:.3f}, implant {implant:.4f} of the view's middle")
    assert bone > 0.02, f"no skull in bone colour in the page's 3-D view ({bone:.3f})"
    assert implant > 0.002, f"no implant in the agreement colours in the page's 3-D view ({implant:.4f})"


@pytest.fixture(scope="module")
def on_the_page(tiny_models, tmp_path_factory) -> dict:
    """One session on the page, as a person would: sign in as alice, upload, open the case and its 3-D view,
    make proposal 1's STL at 3 mm and download it; what the page showed, the file and the audit log after."""
    from selenium.webdriver.common.by import By

    pcdiff, voxelizer, skull = tiny_models
    tmp_path = tmp_path_factory.mktemp("page")
    with case_open_on_the_page(tmp_path, pcdiff, voxelizer, skull, timeout=120) as page:
        driver = page.driver
        check_the_view(driver, tmp_path)
        summary = driver.find_element(By.ID, "case-summary").text
        result = make_printable(driver, choice="1", thickness_mm=3.0)
        driver.find_element(By.ID, "download-stl").click()
        wait_for(lambda: list(page.downloads.glob("*.stl")), 60, "the STL download")
        wait_for(lambda: not list(page.downloads.glob("*.crdownload")), 30, "the download to complete")
        refused = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
        audit = page.server.client.get("/api/audit", headers={"Authorization": f"Bearer {page.admin}"})
    return {
        "case": page.case,
        "summary": summary,
        "result": result,
        "stls": list(page.downloads.glob("*.stl")),
        "csp_refusals": refused,
        "audit": audit,
    }


def test_the_page_shows_the_case_and_makes_and_downloads_the_chosen_stl_watertight(on_the_page):
    assert not on_the_page["csp_refusals"], f"the policy blocked part of the page: {on_the_page['csp_refusals'][:3]}"
    assert "agreement" in on_the_page["summary"] and "watertight" in on_the_page["summary"]
    result = on_the_page["result"]
    assert result.startswith("proposal 1: measured minimum thickness") and "(asked 3 mm, margin 0 mm)" in result
    assert "overlap with the skull" in result and "watertight" in result and "NOT" not in result, result
    (stl,) = on_the_page["stls"]
    assert stl.name.endswith(f"-{on_the_page['case']}-proposal1-t3mm-m0mm.stl"), stl.name  # case and choice
    mesh = trimesh.load(stl, file_type="stl")
    assert mesh.is_watertight and len(mesh.faces) > 0


def test_the_downloaded_stl_reads_at_least_as_thick_as_asked_at_a_sixth_of_it(on_the_page):
    shown_mm = float(on_the_page["result"].split("measured minimum thickness ")[1].split(" mm")[0])
    mesh = trimesh.load(on_the_page["stls"][0], file_type="stl")
    assert min(shown_mm, min_wall_thickness(mesh, 0.5001, 4.5)) >= 3.0, on_the_page["result"]


def test_each_action_on_the_page_is_logged_once_under_the_person_who_signed_in(on_the_page):
    audit, case = on_the_page["audit"], on_the_page["case"]
    assert audit.status_code == 200, audit.text
    logged = [json.loads(line) for line in audit.text.splitlines()]
    alices = [(e["action"], e["case"], e["detail"]) for e in logged if e["person"] == "alice"]
    assert alices == [
        ("sign-in", None, ""),
        ("upload", case, ""),
        ("view", case, ""),
        ("print", case, "proposal1-t3mm-m0mm"),
        ("download", case, "stl proposal1-t3mm-m0mm"),
    ], alices
    others = [(e["person"], e["action"]) for e in logged if e["person"] != "alice"]
    # Before signing in, the page's first look (and the browser's favicon) are refused, under nobody's name.
    assert set(others) == {(None, "refused"), ("root", "audit-download")} and others[-1][0] == "root", others

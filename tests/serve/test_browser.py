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
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import trimesh
from matplotlib.image import imread

from pointforge.implant.thickness import min_wall_thickness
from pointforge.serve.tokens import TokenStore
from tests.implant.test_browser import colour_fractions
from tests.serve.live import LiveServer

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="no chromium or chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run installs them)",
    ),
    pytest.mark.timeout(600),  # the tiny models may be trained first, in the session fixture
]


def browser(downloads: Path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[dev])")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"):
        options.add_argument(flag)
    options.add_argument("--window-size=1200,1800")
    options.add_argument(f"--user-data-dir={downloads.parent / 'chromium-profile'}")
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads)})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}")


def sign_in_and_upload(driver, token: str, skull: Path):
    from selenium.webdriver.common.by import By

    wait_for(lambda: driver.find_element(By.ID, "signin").is_displayed(), 30, "the sign-in form")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#signin-form button").click()
    wait_for(lambda: driver.find_element(By.ID, "main").is_displayed(), 30, "the page after signing in")
    driver.find_element(By.ID, "file").send_keys(str(skull))
    driver.find_element(By.ID, "upload-button").click()


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


def make_printable(driver, choice: str, thickness_mm: float, timeout: float = 300) -> str:
    """Choose ``choice`` and the thickness on the page, make the STL; the result line the page shows.
    ``timeout`` guards a hang, not a speed: on two loaded cores the STL took over 120 s."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "printable-choice")).select_by_value(choice)
    field = driver.find_element(By.ID, "min-thickness")
    field.clear()
    field.send_keys(f"{thickness_mm:g}")
    driver.find_element(By.ID, "printable-button").click()
    shown = wait_for(
        lambda: (
            "measured minimum" in driver.find_element(By.ID, "printable-result").text
            or driver.find_element(By.ID, "printable-error").text
        ),
        timeout,
        "the print-ready STL",
    )
    assert shown is True, f"the page refused the STL: {shown}"
    return driver.find_element(By.ID, "printable-result").text


@pytest.fixture(scope="module")
def on_the_page(tiny_models, tmp_path_factory) -> dict:
    """One session on the page, as a person would: sign in as alice, upload, open the case and its 3-D view,
    make proposal 1's STL at 3 mm and download it; what the page showed, the file and the audit log after."""
    from selenium.webdriver.common.by import By

    pcdiff, voxelizer, skull = tiny_models
    tmp_path = tmp_path_factory.mktemp("page")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    tokens = TokenStore(tmp_path / "data")
    alice, admin = tokens.add("alice"), tokens.add("root", admin=True)
    tokens.close()
    server = LiveServer(tmp_path / "data", pcdiff, voxelizer)
    driver = browser(downloads)
    try:
        driver.get(server.url)
        sign_in_and_upload(driver, alice, skull)
        link = wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#cases tr.done a"), 120, "the case to finish on the page"
        )[0]
        case = link.get_attribute("href").rsplit("#", 1)[1]
        link.click()
        check_the_view(driver, tmp_path)
        summary = driver.find_element(By.ID, "case-summary").text
        result = make_printable(driver, choice="1", thickness_mm=3.0)
        driver.find_element(By.ID, "download-stl").click()
        wait_for(lambda: list(downloads.glob("*.stl")), 60, "the STL download")
        wait_for(lambda: not list(downloads.glob("*.crdownload")), 30, "the download to complete")
        refused = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
        audit = server.client.get("/api/audit", headers={"Authorization": f"Bearer {admin}"})
    finally:
        driver.quit()
        server.kill()
    return {
        "case": case,
        "summary": summary,
        "result": result,
        "stls": list(downloads.glob("*.stl")),
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


def test_the_downloaded_stl_is_at_least_as_thick_as_asked_measured_finer(on_the_page):
    mesh = trimesh.load(on_the_page["stls"][0], file_type="stl")
    assert min_wall_thickness(mesh, 0.4, 4.5) >= 3.0


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

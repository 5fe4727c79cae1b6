"""The page in a real browser: the distribution's headless Chromium, driven by Selenium through its chromedriver.

Against a real `pointforge serve` process on the tiny models: choose a file
and upload it on the page, wait until the case is listed as done, open it,
check that its 3-D view shows the skull in bone colour and the implant in the
agreement colours (the colour check of tests/implant/test_browser.py), and
download the STL through its link and check that it is watertight. .ci/run
installs chromium and chromium-driver; without them this test skips and says why.
"""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import trimesh
from matplotlib.image import imread

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


def test_a_case_uploaded_on_the_page_is_shown_in_3d_and_its_stl_downloads_watertight(tiny_models, tmp_path):
    from selenium.webdriver.common.by import By

    pcdiff, voxelizer, skull = tiny_models
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    server = LiveServer(tmp_path / "data", pcdiff, voxelizer)
    driver = browser(downloads)
    try:
        driver.get(server.url)
        wait_for(lambda: driver.find_element(By.ID, "main").is_displayed(), 30, "the page")
        driver.find_element(By.ID, "file").send_keys(str(skull))
        driver.find_element(By.ID, "upload-button").click()
        link = wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#cases tr.done a"), 120, "the case to finish on the page"
        )[0]
        link.click()
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
        refused = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
        assert not refused, f"the content security policy blocked part of the page: {refused[:3]}"
        summary = driver.find_element(By.ID, "case-summary").text
        assert "agreement" in summary and "watertight" in summary
        driver.find_element(By.ID, "download-stl").click()
        stl = wait_for(lambda: [p for p in downloads.glob("*.stl")], 30, "the STL download")[0]
        wait_for(lambda: not list(downloads.glob("*.crdownload")), 30, "the download to complete")
        mesh = trimesh.load(stl, file_type="stl")
        assert mesh.is_watertight and len(mesh.faces) > 0
    finally:
        driver.quit()
        server.kill()

"""The browser side of the page tests: the distribution's headless Chromium through Selenium, a live
server on the tiny models with named tokens, and the steps every page test takes (sign in, upload,
open the finished case, make a print-ready STL)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pointforge.serve.tokens import TokenStore
from tests.serve.live import LiveServer

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
CHROMEDRIVER = shutil.which("chromedriver")
NO_BROWSER = "no chromium or chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run installs them)"


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


@dataclass
class OpenCase:
    """A browser signed in as alice on a live server, showing her finished case ``case``."""

    driver: object
    server: LiveServer
    downloads: Path
    alice: str
    admin: str
    case: str

    def close_browser(self) -> None:
        if self.driver is not None:
            self.driver.quit()
            self.driver = None


@contextmanager
def case_open_on_the_page(
    tmp_path: Path, pcdiff: Path, voxelizer: Path, upload: Path, timeout: float
) -> Iterator[OpenCase]:
    """Tokens for alice and an admin, ``pointforge serve`` on the models and a browser; alice signs in,
    uploads ``upload`` and opens the case once the page lists it as done (a failed case fails the test
    with the server's output). The browser and the server are stopped on leaving."""
    from selenium.webdriver.common.by import By

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    tokens = TokenStore(tmp_path / "data")
    alice, admin = tokens.add("alice"), tokens.add("root", admin=True)
    tokens.close()
    server = LiveServer(tmp_path / "data", pcdiff, voxelizer)
    page = OpenCase(None, server, downloads, alice, admin, "")
    try:
        page.driver = driver = browser(downloads)
        driver.get(server.url)
        sign_in_and_upload(driver, alice, upload)
        finished = "#cases tr.done a, #cases tr.failed"
        (link, *_) = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, finished), timeout, "the case to finish")
        assert link.tag_name == "a", f"the case failed: {link.text}\n{server.job.output()[-2000:]}"
        page.case = link.get_attribute("href").rsplit("#", 1)[1]
        link.click()
        yield page
    finally:
        page.close_browser()
        server.kill()

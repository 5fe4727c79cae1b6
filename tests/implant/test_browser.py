"""view.html and report.html opened in a real browser: headless Chromium, software WebGL.

Each page is rendered and screenshotted by the distribution's ``chromium``
(.ci/run installs it when missing; without it these tests skip and say why),
and the screenshot must show the skull in bone colour and the implant in the
agreement colours, in the middle of the page (not only in the legend or the
colour bar): a blank canvas, a WebGL error or a missing script fails. The case
is built from small arrays (tests/implant/test_view.py), nothing is trained.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import rgb_to_hsv
from matplotlib.image import imread

from pointforge.implant import view
from pointforge.implant.demo.report import write_report
from tests.implant.test_demo import report_inputs
from tests.implant.test_view import tiny_case

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run installs it)"
)


def screenshot(page: Path, png: Path, width: int, height: int) -> np.ndarray:
    """``page`` rendered by headless Chromium (WebGL by SwiftShader, in software); the RGB pixels in [0, 1]."""
    profile = png.parent / f"{png.stem}-profile"
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--use-angle=swiftshader",
        "--enable-unsafe-swiftshader",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--virtual-time-budget=20000",  # wait until the page is idle (plotly has drawn), up to 20 s of page time
        f"--screenshot={png}",
        page.resolve().as_uri(),
    ]
    env = {**os.environ, "HOME": str(png.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    return imread(png)[..., :3].astype(np.float64)


def colour_fractions(pixels: np.ndarray) -> tuple[float, float]:
    """The fractions of pixels that look like bone (warm, pale) and like the implant (saturated plasma)."""
    hsv = rgb_to_hsv(np.clip(pixels, 0, 1))
    hue, sat, val = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    bone = (hue > 0.06) & (hue < 0.17) & (sat > 0.06) & (sat < 0.4) & (val > 0.25)
    implant = (sat > 0.55) & (val > 0.3) & ((hue < 0.2) | (hue > 0.7))
    return float(bone.mean()), float(implant.mean())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A demo report (two cases, one failed) whose case bilateral/001 is a real case folder, as the demo writes it."""
    out = tmp_path_factory.mktemp("browser")
    summary, test, baseline = report_inputs(out)
    folder = test["root"] / "bilateral/001"
    shutil.rmtree(folder)
    view.write_plotly_js(out / view.PLOTLY_JS)  # where the demo writes it: one copy for every case
    tiny_case(folder, js_src=Path(os.path.relpath(out / view.PLOTLY_JS, folder)).as_posix())
    _, page = write_report(out, summary, test, baseline)
    return page


def test_view_html_renders_the_skull_and_the_implant_in_chromium(report, tmp_path):
    pixels = screenshot(report.parent / "implants/test/bilateral/001/view.html", tmp_path / "view.png", 1000, 800)
    assert pixels.std() > 0.05, "the page is blank"
    middle = pixels[150:750, 250:750]  # the scene, away from the legend (left) and the colour bar (right)
    bone, implant = colour_fractions(middle)
    assert bone > 0.05, f"no skull in bone colour on the page ({bone:.3f} of the scene)"
    assert implant > 0.01, f"no implant in the agreement colours on the page ({implant:.3f} of the scene)"


def test_report_html_shows_tables_thumbnails_and_an_embedded_3d_view_in_chromium(report, tmp_path):
    text = report.read_text()
    assert "href='implants/test/bilateral/001/view.html'" in text
    assert "src='implants/test/bilateral/001/preview.png'" in text
    pixels = screenshot(report, tmp_path / "report.png", 1000, 5200)
    rows = np.flatnonzero((pixels.std(axis=(1, 2)) > 0.02))
    assert rows.size and rows.max() > 1500, "the page ends early: tables, curve or gallery missing"
    bone, implant = colour_fractions(pixels)
    assert bone > 0.004, f"no skull in bone colour on the report ({bone:.4f})"
    assert implant > 0.002, f"no implant colours on the report ({implant:.4f})"
    embedded = pixels[int(rows.max()) - 1400 : int(rows.max())]
    assert colour_fractions(embedded)[0] > 0.01, "the embedded 3-D view shows no skull"

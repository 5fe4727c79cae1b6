"""view.html: the turnable 3-D page of a case, its meshes, sizes and the `pointforge view` command.

A case is built from small arrays (a shell for the skull, its cap as the
implant) and written by the same writer `generate` uses, so nothing is trained.
Whether the page renders in a real browser is tests/implant/test_browser.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pointforge.data.volumes import Volume, read_volume, write_volume
from pointforge.errors import DataError, UserError
from pointforge.implant import view
from pointforge.implant.pipeline import Generated
from pointforge.implant.writer import REPORT, check_label, labelled, write_case
from tests.helpers import run_cli, shell_mask

SPACING = (3.5, 3.5, 3.5)
ORIGIN = (-80.0, -90.0, -70.0)


def tiny_generated(size: int = 44, foreground: int | None = 255) -> Generated:
    """A skull (shell open at the top) and its cap as the implant; proposal 1 misses a strip of it."""
    shell = shell_mask((size,) * 3, radii=(18, 17, 16), thickness=3.0)
    cap = shell.copy()
    cap[..., : int(size * 0.72)] = False
    skull = shell & ~cap
    second = cap.copy()
    second[: size // 2 - 4] = False
    agreement = (cap.astype(np.float32) + second.astype(np.float32)) / 2
    ref = Volume(skull, spacing=SPACING, origin=ORIGIN, foreground=foreground)
    points = np.argwhere(cap)[None, :64].astype(np.float32).repeat(2, axis=0)
    return Generated(ref, cap, [cap, second], agreement, points, timings={"sample_s": 0.1})


def tiny_case(folder: Path, *, label: float = 255, js_src: str = view.PLOTLY_JS) -> Path:
    """A case folder as `generate` writes it (report.json last), from :func:`tiny_generated`."""
    report = write_case(
        tiny_generated(), folder, suffix=".nrrd", report={"title": "tiny case"}, label=label, js_src=js_src
    )
    (folder / REPORT).write_text(json.dumps(report, default=str))
    return folder


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Path:
    return tiny_case(tmp_path_factory.mktemp("view") / "case")


def test_a_case_page_shows_skull_implant_and_switchable_proposals_offline(case):
    page = (case / "view.html").read_text()
    assert '<script charset="utf-8" src="plotly.min.js"></script>' in page
    assert "cdn" not in page.lower() and "https://" not in page.split("Plotly.newPlot")[1][:2000]
    js = case / view.PLOTLY_JS
    assert js.stat().st_size > 1_000_000 and b"plotly" in js.read_bytes()[:2000].lower()
    for name in ("defective skull", "implant (colour: agreement)", "proposal 0", "proposal 1"):
        assert f'"name":"{name}"' in page
    assert page.count('"visible":"legendonly"') == 2  # proposals start hidden, a click shows each
    assert '"colorscale"' in page and "agreement of\\u003cbr\\u003e2 proposals" in page
    assert (case / "view.html").stat().st_size < 3_000_000


def test_surfaces_are_in_mm_in_the_scan_space_and_decimated_to_the_budget():
    g = tiny_generated(size=60)
    verts, mm, faces = view.surface_mm(g.implant, g.defective, 100_000)
    np.testing.assert_allclose(mm, verts * np.asarray(SPACING) + np.asarray(ORIGIN))
    idx = np.argwhere(g.implant)
    lo = idx.min(0) * np.asarray(SPACING) + np.asarray(ORIGIN)
    hi = idx.max(0) * np.asarray(SPACING) + np.asarray(ORIGIN)
    assert np.all(mm.min(0) >= lo - SPACING[0]) and np.all(mm.max(0) <= hi + SPACING[0])
    full = len(faces)
    _, small_mm, small = view.surface_mm(g.implant, g.defective, full // 4)
    assert len(small) <= full // 4 < full
    np.testing.assert_allclose(small_mm.min(0), mm.min(0), atol=2 * SPACING[0])  # same shape, fewer faces
    np.testing.assert_allclose(small_mm.max(0), mm.max(0), atol=2 * SPACING[0])


def test_a_mask_wider_than_the_grid_is_marched_on_blocks_where_the_full_mesh_lies(monkeypatch):
    from scipy.spatial import cKDTree

    g = tiny_generated(size=60)
    full_verts, full_mm, _ = view.surface_mm(g.defective.data, g.defective, 10**9)
    monkeypatch.setattr(view, "MAX_GRID", 20)  # the skull's box is about 40 voxels: blocks of 2
    verts, mm, faces = view.surface_mm(g.defective.data, g.defective, 10**9, mesh=(np.zeros((0, 3)), np.zeros((0, 3))))
    assert 0 < len(faces) and len(verts) < len(full_verts) / 2  # marched on blocks, the mesh handed over unused
    np.testing.assert_allclose(mm, verts * np.asarray(SPACING) + np.asarray(ORIGIN))
    # Every block-surface vertex lies within a block (2 voxels) of a full-surface vertex, and each full-surface
    # vertex within a block's diagonal step (the coarse vertices are a block apart) of a block-surface one.
    assert cKDTree(full_verts).query(verts)[0].max() <= 2.0
    assert cKDTree(verts).query(full_verts)[0].max() <= 1.5 * np.sqrt(2) + 1e-9


def test_implant_vertices_take_the_agreement_of_the_voxels_they_bound():
    g = tiny_generated()
    verts, _, _ = view.surface_mm(g.implant, g.defective, 100_000)
    values = view._agreement_at(verts, g.implant, g.agreement)
    assert set(np.unique(values)) <= {0.5, 1.0}
    assert (values == 1.0).mean() > 0.3 and (values == 0.5).mean() > 0.1
    # Dilating only the implant's box gives what dilating the whole volume gives.
    from scipy.ndimage import grey_dilation

    whole = grey_dilation(np.where(g.implant, g.agreement, 0.0).astype(np.float32), size=(3, 3, 3))
    idx = np.clip(np.rint(verts).astype(np.int64), 0, np.asarray(g.implant.shape) - 1)
    assert np.array_equal(values, whole[idx[:, 0], idx[:, 1], idx[:, 2]])


def test_outputs_carry_the_label_and_a_bad_label_is_refused(case):
    for name in ("implant.nrrd", "proposals/implant_0.nrrd", "completed_skull.nrrd"):
        data = read_volume(case / name).data
        assert data.dtype == np.uint8 and set(np.unique(data)) == {0, 255}, name
    assert read_volume(case / "uncertainty.nrrd").data.max() == pytest.approx(1.0)
    big = labelled(np.array([True, False]), 1000)
    assert big.dtype == np.uint16 and big.tolist() == [1000, 0]
    assert labelled(np.array([True]), 0.5).dtype == np.float32
    for bad in (0, -1, float("nan")):
        with pytest.raises(UserError, match="--label must be a positive number"):
            check_label(bad)


def test_view_command_for_a_case_folder_and_for_an_implant_file(case, tmp_path):
    result = run_cli("view", case, "--out", tmp_path / "pages" / "again.html")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "pages" / "again.html").is_file() and "MB" in result.output
    assert (tmp_path / "pages" / "plotly.min.js").is_file()

    g = tiny_generated()
    write_volume(tmp_path / "skull.nrrd", g.defective)
    write_volume(tmp_path / "implant.nrrd", g.defective.with_data(g.implant))
    result = run_cli("view", tmp_path / "implant.nrrd", "--skull", tmp_path / "skull.nrrd")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "implant.view.html").read_text()
    assert '"name":"implant"' in page and '"name":"defective skull"' in page and (tmp_path / "plotly.min.js").is_file()


def test_view_command_refusals_are_one_line(tmp_path):
    result = run_cli("view", tmp_path / "nothing")
    assert isinstance(result.exception, UserError) and "no such file or folder" in str(result.exception)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a case folder written by pointforge generate"):
        view.case_layers(tmp_path / "empty")
    g = tiny_generated()
    write_volume(tmp_path / "implant.nrrd", g.defective.with_data(g.implant))
    result = run_cli("view", tmp_path / "implant.nrrd")
    assert isinstance(result.exception, UserError) and "--skull" in str(result.exception)
    write_volume(tmp_path / "small.nrrd", np.pad(np.ones((4, 4, 4), bool), 2))
    with pytest.raises(DataError, match="not on one grid"):
        view.file_layers(tmp_path / "implant.nrrd", tmp_path / "small.nrrd")


def test_a_skull_mesh_handed_over_is_used_and_gives_the_page_marching_gives():
    """The writer hands the surface stage's skull mesh to the view: the traces are those of marching the skull
    again (compared trace by trace: the page's div id is random), and the mesh handed over is what is drawn."""
    from pointforge.data.surface import volume_to_mesh

    g = tiny_generated(size=60)
    layers = view.ViewLayers(g.defective, g.defective.data, g.implant, g.agreement, list(g.proposals), "t")
    given = view.ViewLayers(**{**vars(layers), "skull_mesh": volume_to_mesh(g.defective.data)})
    marched, handed = view._traces(layers), view._traces(given)
    assert [t["name"] for t in marched] == [t["name"] for t in handed]
    for a, b in zip(marched, handed):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)
    other = view.ViewLayers(**{**vars(layers), "skull_mesh": volume_to_mesh(g.implant)})
    assert len(view._traces(other)[0]["i"]) != len(marched[0]["i"])

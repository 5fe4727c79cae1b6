"""The print-ready implant: the chosen mask grown to a minimum thickness and a margin, closed, measured on the mesh."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import trimesh
from scipy import ndimage

from pointforge.data.volumes import Volume, write_volume
from pointforge.errors import ConfigError, UserError
from pointforge.implant import printable
from pointforge.implant.printable import PrintOptions, printable_mesh, write_printable
from pointforge.implant.thickness import min_wall_thickness
from tests.helpers import run_cli, shell_mask


@pytest.fixture(scope="module")
def thin_case() -> tuple[Volume, np.ndarray]:
    return thin_dome()


def thin_dome() -> tuple[Volume, np.ndarray]:
    """A skull shell two voxels (4 mm) thick with a defect on top, and its implant one voxel (2 mm) thick."""
    skull = shell_mask((30, 30, 30), radii=(12, 12, 12), thickness=2.0)
    defect = skull & (np.indices(skull.shape)[2] >= 24)
    implant = (
        defect
        & ~shell_mask((30, 30, 30), radii=(11.2, 11.2, 11.2), thickness=1.0)
        & (shell_mask((30, 30, 30), radii=(12, 12, 12), thickness=1.0))
    )
    return Volume(skull & ~defect, spacing=(2.0, 2.0, 2.0)), implant


def test_a_thin_implant_is_grown_to_the_minimum_thickness_and_measured_so(thin_case):
    skull, implant = thin_case
    plain, plain_report = printable_mesh(implant, skull, PrintOptions())
    mesh, report = printable_mesh(implant, skull, PrintOptions(min_thickness_mm=4.0))
    assert mesh.is_watertight and mesh.is_winding_consistent and mesh.volume > 0
    assert plain_report["measured_min_thickness_mm"] < 4.0 <= report["measured_min_thickness_mm"]
    assert mesh.volume > 1.5 * plain.volume
    assert report["overlap_with_skull_mm3"] < 0.05 * mesh.volume


def test_a_margin_lays_a_flange_on_the_skull_around_the_defect(thin_case):
    skull, implant = thin_case
    bare, _ = printable_mesh(implant, skull, PrintOptions(min_thickness_mm=3.0))
    flanged, report = printable_mesh(implant, skull, PrintOptions(min_thickness_mm=3.0, margin_mm=6.0))
    assert flanged.is_watertight and report["measured_min_thickness_mm"] >= 3.0
    below = lambda mesh: mesh.vertices[:, 2].min()  # noqa: E731 - the flange reaches down the dome's sides
    assert below(flanged) < below(bare) - 3.0
    assert flanged.volume > 1.3 * bare.volume


def test_a_cavity_sealed_inside_the_implant_is_filled_so_the_stl_is_one_solid():
    skull = shell_mask((30, 30, 30), radii=(13, 13, 13), thickness=6.0)
    implant = skull & (np.indices(skull.shape)[2] >= 20)
    depth = ndimage.distance_transform_edt(implant)
    centre = np.unravel_index(np.argmax(depth), depth.shape)
    pocket = np.linalg.norm(np.indices(skull.shape) - np.array(centre)[:, None, None, None], axis=0) <= 1.5
    implant &= ~pocket  # a pocket 3 voxels (6 mm) across, sealed inside
    assert ndimage.label(~implant)[1] == 2
    mesh, _ = printable_mesh(
        implant, Volume(skull & ~implant & ~pocket, spacing=(2.0, 2.0, 2.0)), PrintOptions(min_thickness_mm=3.0)
    )
    assert mesh.is_watertight and len(mesh.split(only_watertight=False)) == 1


def test_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="margin needs a minimum thickness"):
        PrintOptions(margin_mm=2.0)
    with pytest.raises(ConfigError, match="'vote' or a proposal"):
        PrintOptions(choice="../x")
    with pytest.raises(ConfigError, match="between 0 and 20"):
        PrintOptions(min_thickness_mm=-1)
    with pytest.raises(ConfigError, match="below 1 mm, too thin to print or to measure in bounded time"):
        PrintOptions(min_thickness_mm=0.5)
    assert PrintOptions(choice="1", min_thickness_mm=3, margin_mm=2).slug() == "proposal1-t3mm-m2mm"


def a_case_folder(tmp_path, thin_case):
    """A folder as ``generate`` writes it, reduced to what the printable STL reads: the vote and two proposals,
    proposal 1 half of the implant (so that it differs from the vote)."""
    skull, implant = thin_case
    case = tmp_path / "case7"
    (case / "proposals").mkdir(parents=True)
    smaller = implant & (np.indices(implant.shape)[1] < 15)  # half of it
    for rel, mask in (("implant.nrrd", implant), ("proposals/implant_0.nrrd", implant)):
        write_volume(case / rel, skull.with_data(mask))
    write_volume(case / "proposals/implant_1.nrrd", skull.with_data(smaller))
    outputs = {"implant": "implant.nrrd", "proposals": ["proposals/implant_0.nrrd", "proposals/implant_1.nrrd"]}
    (case / "report.json").write_text(json.dumps({"outputs": outputs}))
    return case, write_volume(tmp_path / "defective.nrrd", skull)


def test_the_chosen_implant_is_written_once_named_for_the_case_and_the_choice(tmp_path, thin_case, monkeypatch):
    case, defective = a_case_folder(tmp_path, thin_case)
    options = PrintOptions(choice="1", min_thickness_mm=3.0)
    stl, measured = write_printable(case, defective, options)
    assert stl == case / "printable" / "case7-proposal1-t3mm-m0mm.stl"
    mesh = trimesh.load(stl, file_type="stl")
    assert mesh.is_watertight and measured["watertight"] and measured["choice"] == "1"
    assert min_wall_thickness(mesh, 0.5, 4.5) >= 3.0 and measured["measured_min_thickness_mm"] >= 3.0
    vote, _ = write_printable(case, defective, PrintOptions(min_thickness_mm=3.0))
    assert trimesh.load(vote, file_type="stl").volume > 1.1 * mesh.volume  # the vote, not proposal 1
    monkeypatch.setattr(printable, "printable_mesh", lambda *_: pytest.fail("made again"))
    assert write_printable(case, defective, options) == (stl, measured)  # kept: asked again, read back
    with pytest.raises(UserError, match="proposals 0 to 1; choose one of them or 'vote'"):
        write_printable(case, defective, PrintOptions(choice="2"))


def test_a_ct_series_case_is_printed_from_its_series_and_also_as_encapsulated_stl_in_its_frame(tmp_path, thin_case):
    """A case made from a CT series (a zip, as the service keeps it): the skull is read from the series again,
    as `generate` read it, and the STL also comes as Encapsulated STL in the series' Frame of Reference."""
    import pydicom

    from pointforge.data.dicom import read_ct_series
    from tests.dicom_series import ct_series_zip

    skull, implant = thin_case
    series_zip = tmp_path / "ct.zip"
    series_zip.write_bytes(ct_series_zip(np.where(skull.data, 1200.0, 20.0), spacing=(2.0, 2.0, 2.0)))
    series = read_ct_series(series_zip)
    assert np.array_equal(series.skull.data, skull.data)  # the series' own grid: the implant lies on it
    case, mask = a_case_folder(tmp_path, (series.skull, implant))
    stl, measured = write_printable(case, series_zip, PrintOptions(choice="1", min_thickness_mm=3.0))
    assert measured["measured_min_thickness_mm"] >= 3.0 and measured["stl_dicom"] == "case7-proposal1-t3mm-m0mm.dcm"
    ds = pydicom.dcmread(stl.parent / measured["stl_dicom"])
    assert ds.SOPClassUID == pydicom.uid.EncapsulatedSTLStorage and "proposal1-t3mm-m0mm" in ds.SeriesDescription
    assert (
        ds.FrameOfReferenceUID == series.frame_of_reference_uid
        and ds.StudyInstanceUID == series.headers[0].StudyInstanceUID
    )
    assert bytes(ds.EncapsulatedDocument)[: ds.EncapsulatedDocumentLength] == stl.read_bytes()
    from_series = trimesh.load(stl, file_type="stl").vertices
    (stl.parent / measured["stl_dicom"]).rename(tmp_path / "kept.dcm")
    stl.unlink()  # made again from the mask the series gives: the same mesh, in the same patient coordinates
    again, measured_again = write_printable(case, mask, PrintOptions(choice="1", min_thickness_mm=3.0))
    assert "stl_dicom" not in measured_again and np.array_equal(
        trimesh.load(again, file_type="stl").vertices, from_series
    )


def test_the_stl_read_back_is_watertight_far_from_the_origin(tmp_path, thin_case):
    """An STL holds float32: far from the origin (a CT's table position, 1,700 mm for the Visible Human head)
    neighbouring vertices round onto one another. The mesh is measured and checked as the file holds it."""
    skull, implant = thin_case
    far = replace(skull, origin=(10_000.0, 10_000.0, 10_000.0))  # float32 steps of 1/1024 mm: 8 triangles collapse
    case, defective = a_case_folder(tmp_path, (far, implant))
    stl, measured = write_printable(case, defective, PrintOptions(min_thickness_mm=3.0))
    mesh = trimesh.load(stl, file_type="stl")
    assert measured["watertight"] and mesh.is_watertight and mesh.volume > 0
    assert min_wall_thickness(mesh, 0.5001, 4.5) >= 3.0


def test_generate_writes_the_print_ready_stl_of_the_chosen_proposal_and_says_its_thickness(
    tiny_implant_models, tmp_path
):
    root, _, pcdiff, voxelizer = tiny_implant_models
    from tests.implant.test_pipeline import a_test_case

    _, source = a_test_case(root)
    models = ("--pcdiff", pcdiff, "--voxelizer", voxelizer, "-n", 2, "--sampler", "ddpm", "--device", "cpu")
    out = tmp_path / "case3"
    result = run_cli("generate", source, *models, "--out", out, "--printable", 1, "--min-thickness", 2.5)
    assert result.exit_code == 0, (result.output, result.exception)
    stl = out / "printable" / "case3-proposal1-t2.5mm-m0mm.stl"
    said = [line for line in result.output.splitlines() if line.startswith("print-ready STL")]
    assert len(said) == 1 and "measured minimum thickness" in said[0] and str(stl) in said[0], result.output
    measured = json.loads(stl.with_name(stl.name[: -len(".stl")] + ".json").read_text())
    assert f"thickness {measured['measured_min_thickness_mm']:g} mm" in said[0]
    assert measured["measured_at_mm"] == round(2.5 / 6, 4) and measured["measured_min_thickness_mm"] >= 2.5
    mesh = trimesh.load(stl, file_type="stl")
    assert measured["watertight"] and mesh.is_watertight and min_wall_thickness(mesh, 2.5 / 6, 3.75) >= 2.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--printable", 2), "--printable 2: this run makes proposals 0 to 1; choose one or 'vote'"),
        (("--printable", "best"), "'vote' or a proposal's number"),
        (("--margin", 2), "a margin needs a minimum thickness"),
        (("--min-thickness", 25), "between 0 and 20"),
    ],
)
def test_wrong_print_options_are_refused_in_one_line_before_any_work(tmp_path, args, message):
    out = tmp_path / "out"
    defective = write_volume(tmp_path / "d.nrrd", shell_mask((16, 16, 16), radii=(6, 6, 6)))
    missing = tmp_path / "no-such-checkpoint.pt"  # refused before the models would be read
    result = run_cli("generate", defective, "--pcdiff", missing, "--voxelizer", missing, "-n", 2, "--out", out, *args)
    # main() turns a UserError into one red line and exit code 2 (test_cli.py); here it arrives raw.
    assert isinstance(result.exception, UserError), (result.output, result.exception)
    assert message in str(result.exception) and "\n" not in str(result.exception)
    assert not out.exists()


def test_generate_on_a_dataset_folder_asks_for_the_print_ready_stl_of_every_case_and_says_so(
    tiny_implant_models, tmp_path, monkeypatch
):
    """The CLI's part; the folder run's (every case, new or done, a failure per case) is in test_pipeline."""
    root, _, pcdiff, voxelizer = tiny_implant_models
    import pointforge.implant.folder as folder

    asked = {}

    def fake_folder(_root, out, _models, _options, **kwargs):
        asked.update(kwargs)
        return folder.FolderResult(done=["a", "b"], printed={"a": "a.stl", "b": "b.stl"})

    monkeypatch.setattr(folder, "generate_folder", fake_folder)
    models = ("--pcdiff", pcdiff, "--voxelizer", voxelizer, "-n", 2, "--device", "cpu")
    result = run_cli("generate", root, *models, "--out", tmp_path / "o", "--printable", 1, "--min-thickness", 2)
    assert result.exit_code == 0, (result.output, result.exception)
    assert asked["printable"] == PrintOptions(choice="1", min_thickness_mm=2.0)
    assert "2 print-ready STL(s)" in result.output

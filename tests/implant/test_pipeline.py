"""`pointforge generate`: the whole pipeline on tiny trained models, its outputs, and bad inputs.

The models are trained through the engine once per test session
(``tiny_implant_models`` in tests/conftest.py, shared with the serve tests),
small enough to take about half a minute together: PCDiff tiny on a short schedule (T = 20, as the overfit test
in test_pcdiff_quality.py) so its samples land on the skull after a few hundred
steps, and the tiny voxelizer. They are far from good; these tests check what
the pipeline does with whatever the models propose (geometry, files, errors),
not the quality of the implants (the demo and bench/pipeline.py measure that).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh
from typer.testing import CliRunner

from pointforge.cli.main import app
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import Volume, read_volume, write_volume
from pointforge.errors import UserError
from pointforge.implant.case import generate_case
from pointforge.implant.folder import generate_folder
from pointforge.implant.models import load_models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.printable import PrintOptions
from pointforge.implant.writer import case_done
from pointforge.tasks import get_task
from pointforge.tasks.configs import load_train_config
from pointforge.train.engine import train
from tests.helpers import CONFIGS, QUIET

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = [*QUIET, "ckpt.every_minutes=0"]


@pytest.fixture(scope="module")
def trained(tiny_implant_models):
    """(prepared root, raw root, pcdiff checkpoint, voxelizer checkpoint), shared with the serve tests."""
    return tiny_implant_models


@pytest.fixture(scope="module")
def models(trained):
    _, _, pc, vox = trained
    return load_models(pc, vox, device="cpu")


FAST = GenerateOptions(ensemble=2, sampler="ddpm", seed=0)


def a_test_case(root: Path):
    data = PreparedDataset(root)
    case = data.split("test")[0]
    return case, Path(data.meta(case.defective)["source"])


def test_one_case_writes_every_output_on_the_input_geometry(trained, models, tmp_path):
    """Every output on the input's own geometry and labels; the same seed gives the same implant again,
    written as 0/1 with --label 1, into an existing folder only with overwrite (refused before any work)."""
    root, raw, _, _ = trained
    case, source = a_test_case(root)
    src = read_volume(source)
    # A geometry nothing else has: the outputs must carry it over exactly.
    moved = src.with_data(src.data.astype(bool).astype(np.uint8) * np.uint8(255))  # a 0/255 skull
    moved.origin = (-101.5, 7.25, 33.0)
    moved.direction = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # a mirroring one
    moved.header = {
        "format": "nrrd",
        "nrrd": {**src.header["nrrd"], "content": "defective skull for the generate test"},
    }
    defective_path = write_volume(tmp_path / "defective.nrrd", moved)
    out = tmp_path / "case"
    report = generate_case(defective_path, out, models, FAST)
    defective = read_volume(defective_path)
    for rel in (
        "implant.nrrd",
        "uncertainty.nrrd",
        "completed_skull.nrrd",
        "proposals/implant_0.nrrd",
        "proposals/implant_1.nrrd",
    ):
        vol = read_volume(out / rel)
        assert vol.shape == defective.shape, rel
        np.testing.assert_allclose(vol.spacing, defective.spacing, err_msg=rel)
        np.testing.assert_allclose(vol.origin, defective.origin, err_msg=rel)
        np.testing.assert_allclose(vol.direction, defective.direction, err_msg=rel)
        assert vol.header["nrrd"].get("content") == "defective skull for the generate test", rel
    for rel in ("implant.nrrd", "completed_skull.nrrd", "proposals/implant_0.nrrd"):  # 0/255 in, 0/255 out
        assert set(np.unique(read_volume(out / rel).data)) == {0, 255}, rel
    assert report["label"]["value"] == 255 and report["label"]["from"] == "the input's foreground value"
    implant = read_volume(out / "implant.nrrd").data.astype(bool)
    bone = defective.data.astype(bool)
    assert implant.any() and not (implant & bone).any()
    assert np.array_equal(read_volume(out / "completed_skull.nrrd").data.astype(bool), implant | bone)
    agreement = read_volume(out / "uncertainty.nrrd").data
    assert agreement.dtype == np.float32 and agreement.min() >= 0 and agreement.max() <= 1
    assert set(np.unique(agreement)) <= {0.0, 0.5, 1.0}  # two proposals
    points = np.load(out / "proposals" / "points.npy")
    assert points.shape == (2, models.pcdiff.config.n_implant, 3)

    mesh = trimesh.load(out / "implant.stl")
    assert mesh.is_watertight and mesh.volume > 0  # closed, normals outward
    # In millimetres in the input's physical space: the mesh lies where the implant voxels are.
    centre_mm = defective.voxel_to_physical(np.argwhere(implant).mean(axis=0))
    assert np.linalg.norm(mesh.center_mass - centre_mm) < 2 * max(defective.spacing)
    voxel_cm3 = implant.sum() * np.prod(defective.spacing) / 1000
    assert abs(mesh.volume / 1000 - voxel_cm3) < 0.2 * voxel_cm3 + 1.0

    assert (out / "preview.png").stat().st_size > 10_000
    assert 'src="plotly.min.js"' in (out / "view.html").read_text() and (out / "plotly.min.js").is_file()
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["parameters"]["ensemble"] == 2 and saved["seed"] == 0
    assert saved["mesh"]["watertight"] and saved["mesh"]["outward_normals"] and saved["mesh"]["units"] == "mm"
    assert abs(saved["implant"]["volume_cm3"] - voxel_cm3) < 1e-3
    assert {"surface_s", "sample_s", "voxelize_s", "postprocess_s", "write_s", "total_s"} <= set(saved["timings_s"])
    assert saved["versions"]["torch"] == torch.__version__
    assert saved["versions"]["ducc0"] == importlib.metadata.version("ducc0")  # the CPU solve's FFTs
    assert saved["models"]["voxelizer"]["preset"] == "tiny"

    # Same seed, same implant; written as 0/1 when asked (--label 1); into an existing folder only with
    # overwrite, which replaces what was there.
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    (again_dir / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        generate_case(defective_path, again_dir, models, FAST, label=1)
    assert (again_dir / "notes.txt").read_text() == "mine"
    again = generate_case(defective_path, again_dir, models, FAST, label=1, overwrite=True)
    assert case_done(again_dir) and not (again_dir / "notes.txt").exists()
    assert np.array_equal(read_volume(again_dir / "implant.nrrd").data, implant.astype(np.uint8))
    assert again["implant"] == report["implant"] and again["label"]["from"] == "--label"


def test_anisotropic_nifti_in_gives_nifti_out_on_its_own_grid(trained, models, tmp_path):
    root, _, _, _ = trained
    _, source = a_test_case(root)
    src = read_volume(source)
    # Every second slice along axis 2 with twice the spacing: a SkullFix-like scan.
    vol = type(src)(
        data=src.data[:, :, ::2].copy(),
        spacing=(src.spacing[0], src.spacing[1], 2 * src.spacing[2]),
        origin=src.origin,
        direction=src.direction,
    )
    path = write_volume(tmp_path / "defective.nii.gz", vol)
    report = generate_case(path, tmp_path / "case", models, FAST)
    assert (tmp_path / "case" / "implant.nii.gz").is_file() and not (tmp_path / "case" / "implant.nrrd").exists()
    implant = read_volume(tmp_path / "case" / "implant.nii.gz")
    assert implant.shape == vol.shape
    np.testing.assert_allclose(implant.spacing, vol.spacing, rtol=1e-6)
    assert implant.data.any() and not (implant.data.astype(bool) & vol.data.astype(bool)).any()
    assert any("isotropic" in note for note in report["notes"])


def test_folder_mode_is_resumable_and_one_bad_case_does_not_stop_the_rest(trained, models, tmp_path, monkeypatch):
    """Three test cases, the first corrupt: the other two are written; a second run skips them. A print-ready
    STL asked for is made for every written case, new or skipped, and one that cannot be made fails its case
    alone, which keeps its implant."""
    root, _, _, _ = trained
    data = PreparedDataset(root)
    cases = data.split("test")[:3]
    assert len(cases) == 3
    # A copy of the prepared dataset with three test cases, the first pointing at a corrupt volume.
    import shutil

    copy = tmp_path / "prepared"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("raw"))
    rows = (copy / "cases.csv").read_text().splitlines(keepends=True)
    kept = {c.case_id for c in cases}
    (copy / "cases.csv").write_text("".join(r for r in rows if ",test," not in r or r.split(",")[0] in kept))
    assert [c.case_id for c in PreparedDataset(copy).split("test")] == [c.case_id for c in cases]
    bad_meta = copy / (cases[0].defective[:-4] + ".json")
    meta = json.loads(bad_meta.read_text())
    corrupt = tmp_path / "corrupt.nrrd"
    corrupt.write_bytes(Path(meta["source"]).read_bytes()[:300])
    meta["source"] = str(corrupt)
    bad_meta.write_text(json.dumps(meta))

    out = tmp_path / "out"
    first = generate_folder(copy, out, models, FAST, split="test")
    assert list(first.failed) == [cases[0].case_id] and "truncated or corrupt" in first.failed[cases[0].case_id]
    assert sorted(first.done) == sorted(c.case_id for c in cases[1:])
    assert not (out / cases[0].case_id).exists()
    assert all(case_done(out / c.case_id) for c in cases[1:])
    assert (out / "plotly.min.js").is_file() and not list(out.glob("*/*/plotly.min.js"))  # one copy for all cases
    assert 'src="../../plotly.min.js"' in (out / cases[1].case_id / "view.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == first.failed

    stamp = (out / cases[1].case_id / "report.json").stat().st_mtime_ns
    second = generate_folder(copy, out, models, FAST, split="test")
    assert sorted(second.skipped) == sorted(first.done) and not second.done
    assert (out / cases[1].case_id / "report.json").stat().st_mtime_ns == stamp

    import pointforge.implant.folder as folder

    printed = []

    def fake_print(case, source, options):  # write_printable itself: test_printable.py
        printed.append((case.relative_to(out).as_posix(), source, options))
        if printed[-1][0] == cases[2].case_id:
            raise UserError("measured 1.00 mm after growing it 2 times")
        return case / "printable" / "it.stl", {}

    monkeypatch.setattr(folder, "write_printable", fake_print)
    third = generate_folder(copy, out, models, FAST, split="test", printable=PrintOptions(min_thickness_mm=2))
    assert sorted(third.skipped) == sorted(c.case_id for c in cases[1:]) and not third.done
    assert [name for name, *_ in printed] == [c.case_id for c in cases[1:]]
    assert list(third.printed) == [cases[1].case_id] and third.failed[cases[2].case_id] == (
        "print-ready STL: measured 1.00 mm after growing it 2 times"
    )
    assert case_done(out / cases[2].case_id)  # its implant is kept


def test_a_failure_while_writing_leaves_nothing_that_looks_complete(trained, models, tmp_path, monkeypatch):
    root, _, _, _ = trained
    _, source = a_test_case(root)
    import pointforge.implant.writer as writer

    def broken(*_a, **_k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(writer, "field_to_mesh", broken)
    out = tmp_path / "case"
    with pytest.raises(OSError, match="disk full"):
        generate_case(source, out, models, FAST)
    assert not out.exists() and not list(tmp_path.glob(".case.partial-*"))


def test_a_full_disk_stops_a_folder_run_at_that_case(trained, models, tmp_path, monkeypatch):
    import errno

    import pointforge.implant.folder as folder

    calls = []

    def full(*_a, **_k):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folder, "generate_case", full)
    with pytest.raises(OSError, match="No space left"):
        generate_folder(trained[0], tmp_path / "out", models, FAST, split="test")
    assert len(calls) == 1  # not recorded as one failed case and tried again on every other


def run_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_bad_inputs_get_one_clear_line_and_leave_nothing(trained, tmp_path):
    root, _, pc, vox = trained
    _, source = a_test_case(root)
    src = read_volume(source)
    label_map = src.data.astype(np.uint8)
    label_map[::3, ::3, ::3] = 2
    labels = write_volume(tmp_path / "labels.nrrd", src.with_data(label_map))
    empty = write_volume(tmp_path / "empty.nrrd", src.with_data(np.zeros(src.shape, np.uint8)))
    import nrrd

    nrrd.write(str(tmp_path / "flat.nrrd"), np.ones((8, 8), np.uint8))
    cases = [
        (labels, pc, vox, "auto", "not a binary mask"),
        (empty, pc, vox, "auto", "empty"),
        (tmp_path / "flat.nrrd", pc, vox, "auto", "expected a 3-D volume"),
        (source, tmp_path / "missing.pt", vox, "auto", "no such file"),
        (source, vox, vox, "auto", "is a voxelizer checkpoint, given as --pcdiff; give it as --voxelizer"),
        (source, pc, pc, "auto", "is a pcdiff checkpoint, given as --voxelizer; give it as --pcdiff"),
        (source, pc, vox, "cuda:7", "cuda:7 does not exist"),
    ]
    for k, (inp, p, v, device, message) in enumerate(cases):
        out = tmp_path / f"out{k}"
        result = run_cli(
            "generate",
            inp,
            "--pcdiff",
            p,
            "--voxelizer",
            v,
            "--out",
            out,
            "--device",
            device,
            "-n",
            1,
            "--sampler",
            "ddpm",
        )
        # main() turns a UserError into one red line and exit code 2 (test_cli.py); here it arrives raw.
        assert isinstance(result.exception, UserError), (message, result.output, result.exception)
        assert message in str(result.exception) and "\n" not in str(result.exception), (message, result.exception)
        assert not out.exists(), message


def test_wrong_options_are_config_errors(models, tmp_path):
    from pointforge.errors import ConfigError

    for options, message in (
        ({"ensemble": 0}, "--ensemble"),
        ({"sampler": "euler"}, "unknown sampler"),
        ({"sampler": "ddpm", "steps": 10}, "ddpm runs all"),
        ({"components": 1.5}, "--components must be a fraction"),
        ({"reach_mm": 0.0}, "--reach-mm must be a positive distance"),
        ({"skull_points": 10}, "--skull-points must be an integer of at least 64"),
        ({"skull_points": True}, "--skull-points must be an integer"),
    ):
        with pytest.raises(ConfigError, match=message):  # when the options are made, or before the input is read
            generate_case(tmp_path / "nothing.nrrd", tmp_path / "out", models, GenerateOptions(**options))
    with pytest.raises(ConfigError, match="--ensemble"):  # changed options are checked again
        replace(FAST, ensemble=0)
    assert not (tmp_path / "out").exists()


def test_generate_checks_options_once_builds_one_sampler_and_reads_each_checkpoint_once(trained, tmp_path, monkeypatch):
    """CLI → case → pipeline → writer, one way: the options are checked when made and never again, the
    sampler is built once, and a checkpoint given to the wrong flag is not read a second time to say so."""
    from collections import Counter

    from pointforge.errors import CheckpointError
    from pointforge.implant import proposals

    root, _, pc, vox = trained
    _, source = a_test_case(root)
    calls: Counter[str] = Counter()
    validate, make_sampler, load = GenerateOptions.validate, proposals.make_sampler, torch.load

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(GenerateOptions, "validate", counted("validate", validate))
    monkeypatch.setattr(proposals, "make_sampler", counted("sampler", make_sampler))
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: counted(str(path), load)(path, *a, **k))
    out = tmp_path / "case"
    result = run_cli("generate", source, "--pcdiff", pc, "--voxelizer", vox, "--out", out, "-n", 1, "--sampler", "ddpm")
    assert result.exit_code == 0, (result.output, result.exception)
    assert case_done(out)
    assert calls == {"validate": 1, "sampler": 1, str(pc): 1, str(vox): 1}, calls
    # The pictures are on request (--pictures): the case has its volumes and mesh, no preview or page.
    assert not (out / "preview.png").exists() and not (out / "view.html").exists()
    assert f"3-D view: pointforge view {out}" in result.output

    calls.clear()
    with pytest.raises(CheckpointError, match="is a voxelizer checkpoint, given as --pcdiff; give it as --voxelizer"):
        load_models(vox, vox, device="cpu")
    assert calls == {str(vox): 1}, calls


def test_generate_writes_the_pictures_when_asked(trained, tmp_path, monkeypatch):
    # What --pictures passes on (writing them is test_one_case_writes_every_output_on_the_input_geometry's).
    from pointforge.implant import case

    root, _, pc, vox = trained
    _, source = a_test_case(root)
    out = tmp_path / "case"
    asked: dict = {}

    def written(*args, **kwargs):
        asked.update(kwargs)
        outputs = {"view": "view.html"} if kwargs["view"] else {}
        mesh = {"watertight": True, "components": 1}
        return {"mesh": mesh, "implant": {"volume_cm3": 1.0}, "timings_s": {"total_s": 1.0}, "outputs": outputs}

    monkeypatch.setattr(case, "generate_case", written)
    result = run_cli("generate", source, "--pcdiff", pc, "--voxelizer", vox, "--out", out, "--pictures")
    assert result.exit_code == 0, (result.output, result.exception)
    assert asked["preview"] is True and asked["view"] is True
    assert f"3-D view: {out / 'view.html'}" in result.output


def test_an_upsampler_densifies_each_proposal_before_voxelising(trained, tmp_path):
    root, _, pc, vox = trained
    _, source = a_test_case(root)
    up = load_train_config(
        "upsampler",
        CONFIGS / "upsampler" / "tiny.yaml",
        [
            *QUIET,
            f"run.dir={tmp_path / 'upsampler'}",
            f"task.data_root={tmp_path / 'up-data'}",
            "train.max_steps=2",
        ],
    )
    up_ckpt = train(get_task("upsampler"), up, console=False).checkpoint
    with_up = load_models(pc, vox, device="cpu", upsample=up_ckpt)
    report = generate_case(source, tmp_path / "case", with_up, FAST)
    assert report["models"]["upsampler"]["ratio"] == 2 and "upsample_s" in report["timings_s"]
    assert np.load(tmp_path / "case" / "proposals" / "points.npy").shape == (2, with_up.pcdiff.config.n_implant, 3)
    assert report["mesh"]["watertight"]
    with pytest.raises(UserError, match="is a pcdiff checkpoint, given as --upsample; give it as --pcdiff"):
        load_models(pc, vox, device="cpu", upsample=pc)


def test_the_voxelizer_gets_as_many_skull_points_as_asked_and_by_default_as_trained(models, monkeypatch):
    from pointforge.implant import pipeline

    seen = []

    def counted(model, points, reference, **kwargs):
        seen.append(len(points))
        return reference.with_data(np.zeros(reference.shape, dtype=bool))

    monkeypatch.setattr(pipeline, "points_to_volume", counted)
    dense = np.zeros((2, models.pcdiff.config.n_implant, 3))
    skull = np.random.default_rng(0).uniform(0, 40, (9000, 3))
    work = Volume(np.zeros((40, 40, 40), dtype=bool), spacing=(1.0, 1.0, 1.0))
    trained = max(models.voxelizer_config.task.n_points - dense.shape[1], models.pcdiff.config.n_skull)
    for asked, expected in ((None, trained), (4096, 4096)):
        seen.clear()
        pipeline._voxelize(dense, skull, work, models, replace(FAST, skull_points=asked), None, cube=None)
        assert seen == [expected + dense.shape[1]] * 2


def test_too_many_proposals_for_memory_are_refused_up_front_with_the_largest_that_fits(trained, models, tmp_path):
    from pointforge.errors import ConfigError
    from pointforge.implant.memory import check_generate_memory, generate_memory_bytes

    root, _, pc, vox = trained
    _, source = a_test_case(root)
    shape = read_volume(source).shape
    options = GenerateOptions(ensemble=50, sampler="ddpm")
    one, two = (generate_memory_bytes(models, options, shape, n) for n in (1, 2))
    assert two["host"] - one["host"] == 3 * int(np.prod(shape))  # a byte per voxel: completed, own implant, agreement
    assert two["device"] > one["device"]  # PCDiff samples every proposal in one batch
    per = two["host"] + two["device"] - one["host"] - one["device"]
    budget = {"device": 0, "host": one["host"] + one["device"] + 3 * per + 10}  # on the CPU both come from RAM
    with pytest.raises(ConfigError) as caught:
        check_generate_memory(models, options, shape, budget=budget)
    assert str(caught.value).endswith("; use --ensemble 4 or fewer") and "50 proposals of a" in str(caught.value)
    options = replace(options, ensemble=4)
    check_generate_memory(models, options, shape, budget=budget)  # fits: no error
    with pytest.raises(ConfigError, match="even for one proposal"):
        check_generate_memory(models, options, shape, budget={"device": 0, "host": 1000})
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            *("generate", str(source), "--pcdiff", str(pc), "--voxelizer", str(vox), "--out", str(out)),
            *("-n", "10000000", "--sampler", "ddpm"),
        ],
    )
    assert isinstance(result.exception, ConfigError) and "\n" not in str(result.exception)
    assert "10000000 proposals of a" in str(result.exception) and "or fewer" in str(result.exception)
    assert not out.exists()


def test_the_memory_check_hands_freed_memory_back_before_measuring(trained, models, monkeypatch):
    # A CPU-loaded PCDiff keeps freed blocks in the heap; the check must count them as free.
    from pointforge.implant import memory

    order: list[str] = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: order.append("release") or True)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: order.append("measure") or 2**50)
    _, source = a_test_case(trained[0])
    shape = read_volume(source).shape
    memory.check_generate_memory(models, GenerateOptions(ensemble=1), shape)
    assert order[:2] == ["release", "measure"]
    order.clear()
    memory.check_generate_memory(models, GenerateOptions(ensemble=1), shape, budget={"device": 0, "host": 2**50})
    assert order == []  # a given budget is not measured


def test_generate_defaults_to_ddim_with_seven_steps(models):
    """The default is the fewest model calls measured within 0.01 DSC of DDPM-1000 (docs/pcdiff.md)."""
    from pointforge.implant.proposals import proposal_sampler

    def sampler_for(options):
        return proposal_sampler(options.sampler, options.steps, models.pcdiff.schedule)

    sampler = sampler_for(GenerateOptions())
    assert sampler.name == "ddim" and sampler.num_steps == 7
    assert sampler_for(GenerateOptions(steps=5)).num_steps == 5
    assert sampler_for(GenerateOptions(sampler="dpm++2m")).name == "dpm++2m"  # its own default


def test_the_surface_stage_keeps_the_skull_mesh_the_view_would_march():
    """The surface stage's mesh is volume_to_mesh of the input itself (kept for view.html), its points
    surface_points'; on a resampled (anisotropic) or turned (permuted header) input there is none to keep."""
    from pointforge.data.surface import surface_points, volume_to_mesh
    from pointforge.data.volumes import Volume
    from pointforge.implant.pipeline import _work_surface
    from tests.helpers import shell_mask

    skull = shell_mask((30, 32, 28), radii=(12, 13, 11), thickness=3.0)
    options = GenerateOptions(surface_points=2000, seed=3)
    work, points, mesh = _work_surface(Volume(skull, spacing=(0.5, 0.5, 0.5)), options, [])
    assert work.scale is None and work.turn.identity and mesh is not None
    for kept, marched in zip(mesh, volume_to_mesh(skull)):
        assert np.array_equal(kept, marched) and kept.dtype == marched.dtype
    assert np.array_equal(points, surface_points(skull, 2000, seed=3))
    notes: list[str] = []
    work, _, mesh = _work_surface(Volume(skull, spacing=(0.5, 0.5, 1.0)), options, notes)
    assert work.scale is not None and mesh is None and notes
    swapped = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    work, _, mesh = _work_surface(Volume(skull, spacing=(0.5, 0.5, 0.5), direction=swapped), options, notes)
    assert not work.turn.identity and work.volume.shape == (32, 30, 28) and mesh is None


def _onto(src, shape, spacing, origin, direction=None):
    """``src`` resampled onto another grid by physical position (trilinear, inside where >= 0.5)."""
    from scipy.ndimage import map_coordinates

    from pointforge.data.volumes import Volume

    grid = Volume(np.zeros(shape, bool), tuple(spacing), tuple(origin), np.eye(3) if direction is None else direction)
    ijk = np.indices(shape).reshape(3, -1).T.astype(np.float64)
    at = src.physical_to_voxel(grid.voxel_to_physical(ijk)).T
    return grid.with_data((map_coordinates(src.data.astype(np.float32), at, order=1) >= 0.5).reshape(shape))


def test_a_skull_from_another_scanner_gets_the_same_implant(trained, models):
    """Voxel size, field of view and orientation of the scan do not change the implant (docs/implant.md, "The frame").

    The same defective skull stored three other ways: with its axes permuted and flipped (the direction matrix
    says so), inside a larger field of view with another origin, and resampled to 0.4/0.45 of its spacing with
    the same voxel count (as SkullBreak's 512³ at 0.4 mm is to SkullFix's 512² at 0.45 mm: a smaller field of
    view). The first two hold the same voxels, so the networks must see the same points: the implants agree
    to DSC 0.98 in physical space (0.987 on one CPU, above 0.99 on another: float sums in another order). The resampled one is a different mask (trilinear resampling of a skull two
    voxels thick), so its surface samples differ as much as another seed's: it must agree with the original at
    least about as well as the original with another seed does (minus 0.1). Before the frame (voxel axes as
    stored, the voxelizer's cube the volume's own) these gave DSC 0.65 (turned), 0.80 (larger field of view),
    and with a framed PCDiff the turned copy was refused: "the PCDiff proposals fall outside the volume (70 %...)".
    """
    from pointforge.data.volumes import read_binary_volume
    from pointforge.implant.pipeline import generate_implant
    from tests.data.test_orientation import turned_copy

    assert models.voxelizer_frame is not None and models.voxelizer_frame.cube_mm == pytest.approx(230.0)
    root, _, _, _ = trained
    data = PreparedDataset(root)
    case = next(c for c in data.split("test") if c.defect == "parietotemporal")
    original = read_binary_volume(Path(data.meta(case.defective)["source"]))
    implant = generate_implant(original, models, FAST).implant
    again = generate_implant(original, models, GenerateOptions(ensemble=2, sampler="ddpm", seed=1)).implant

    def dsc(a, b):
        return 2 * (a & b).sum() / (a.sum() + b.sum())

    def agreement(copy):
        result = generate_implant(copy, models, FAST)
        solid = copy.with_data(result.implant)
        return dsc(_onto(solid, original.shape, original.spacing, original.origin, original.direction).data, implant)

    spacing = np.asarray(original.spacing)
    lo, hi = np.array([6, 0, 4]), np.array([0, 9, 12])
    larger = _onto(original, tuple(np.asarray(original.shape) + lo + hi), spacing, original.voxel_to_physical(-lo))
    assert agreement(turned_copy(original, (2, 0, 1), (False, True, True))) > 0.98
    assert agreement(larger) > 0.98
    centre = original.voxel_to_physical((np.asarray(original.shape) - 1) / 2)
    finer = spacing * 0.4 / 0.45
    smaller_fov = _onto(original, original.shape, finer, centre - (np.asarray(original.shape) - 1) / 2 * finer)
    assert agreement(smaller_fov) >= dsc(again, implant) - 0.1


def test_a_voxelizer_without_a_frame_sees_the_volumes_own_cube(trained, models, tmp_path):
    """A voxelizer checkpoint written before the frame (no frame buffers) loads, and generate gives it the
    volume's own cube as before the frame, with a note: the same implant as the loaded models with their
    frame taken away."""
    from pointforge.data.volumes import read_binary_volume
    from pointforge.implant.pipeline import generate_implant
    from pointforge.train.checkpoint import format as ck

    root, _, pc, vox = trained
    ckpt = ck.load_checkpoint(vox)
    for weights in ("model", "ema"):
        if ckpt.get(weights) is not None:
            ckpt[weights] = {k: v for k, v in ckpt[weights].items() if not k.startswith("frame_")}
    ck.save_checkpoint(tmp_path / "old.pt", ckpt)
    old = load_models(pc, tmp_path / "old.pt", device="cpu")
    assert old.voxelizer_frame is None and models.voxelizer_frame is not None

    _, source = a_test_case(root)
    defective = read_binary_volume(source)
    result = generate_implant(defective, old, FAST)
    assert any("carries no training cube" in note for note in result.notes)
    unframed = generate_implant(defective, replace(models, voxelizer_frame=None), FAST)
    assert np.array_equal(result.implant, unframed.implant) and result.implant.any()


def test_scoring_without_each_proposals_implant_gives_the_same_implant_and_cannot_be_written(trained, models, tmp_path):
    """``each=False`` (the demo's scoring) skips the own implants and the agreement map, not the implant;
    such a result is refused by the writer before anything is written."""
    from pointforge.data.volumes import read_binary_volume
    from pointforge.implant.pipeline import generate_implant
    from pointforge.implant.writer import write_case

    root, _, _, _ = trained
    data = PreparedDataset(root)
    case = next(c for c in data.split("test") if c.defect == "parietotemporal")
    defective = read_binary_volume(Path(data.meta(case.defective)["source"]))
    full = generate_implant(defective, models, FAST)
    voted = generate_implant(defective, models, FAST, each=False)
    assert voted.implant.any() and np.array_equal(voted.implant, full.implant)
    assert voted.proposals == [] and voted.agreement is None and len(full.proposals) == FAST.ensemble
    assert "agreement_s" not in voted.timings and "vote_s" in voted.timings
    with pytest.raises(ValueError, match="each=True"):
        write_case(voted, tmp_path / "case", suffix=".nrrd", report={})
    assert not (tmp_path / "case").exists()

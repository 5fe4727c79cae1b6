"""DICOM out: the implant as a Segmentation and the mesh as Encapsulated STL, read back in the CT's frame.

The geometry is checked against the input: every SEG pixel, placed by its own
frame's position, orientation and spacing, is an implant voxel of the case, and
the implant lands on the CT's bone within one voxel; the STL's vertices are in
the same patient coordinates.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from pointforge.data.dicom import ct_series_from_bytes
from pointforge.data.volumes import read_volume
from pointforge.implant.case import generate_case
from pointforge.implant.dicom_out import write_encapsulated_stl, write_segmentation
from pointforge.implant.models import load_models
from pointforge.implant.options import GenerateOptions
from tests.dicom_series import ct_slices, in_folder, nearest_mm, seg_points, shell_hounsfield

CENTRE, RADIUS, THICKNESS = (20.0, 22.0, 30.0), 16.0, 4.0
TILT = math.radians(12.0)


@pytest.fixture(scope="module")
def tilted_series():
    orientation = (1.0, 0.0, 0.0, 0.0, math.cos(TILT), -math.sin(TILT))
    positions = [(0.0, -2.0, z) for z in np.arange(0.0, 62.0, 1.0 / math.cos(TILT))]
    return ct_series_from_bytes(
        ct_slices(shell_hounsfield(CENTRE, RADIUS, THICKNESS), positions, size=(44, 56), orientation=orientation)
    )


def test_the_segmentation_holds_the_implant_voxels_in_the_cts_frame_of_reference(tilted_series, tmp_path):
    skull = tilted_series.skull
    cap = skull.data & (skull.voxel_to_physical(np.indices(skull.shape).reshape(3, -1).T)[:, 2] > 38).reshape(
        skull.shape
    )  # a piece of the bone's top stands in for an implant
    path = write_segmentation(tmp_path / "seg.dcm", skull.with_data(cap), tilted_series.headers, description="test")
    seg, points = seg_points(path)
    source = tilted_series.headers[0]
    assert seg.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert seg.StudyInstanceUID == source.StudyInstanceUID and seg.PatientID == source.PatientID
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == source.SeriesInstanceUID
    assert seg.SegmentSequence[0].SegmentLabel == "Implant"
    expected = skull.voxel_to_physical(np.argwhere(cap))
    assert len(points) == len(expected) and nearest_mm(points, expected).max() < 1e-3
    # on the CT's own bone: every pixel within one voxel of the true shell
    distance = np.linalg.norm(points - np.asarray(CENTRE), axis=1)
    outside = np.maximum(distance - RADIUS, RADIUS - THICKNESS - distance)
    assert outside.max() <= math.sqrt(3) * max(skull.spacing)


def test_the_encapsulated_stl_keeps_the_mesh_and_the_frame_of_reference(tilted_series, tmp_path):
    import pydicom
    import trimesh

    mesh = trimesh.creation.icosphere(subdivisions=2, radius=5.0)
    mesh.apply_translation(CENTRE)
    stl = trimesh.exchange.stl.export_stl(mesh)
    path = write_encapsulated_stl(tmp_path / "stl.dcm", stl, tilted_series.headers, description="test")
    ds = pydicom.dcmread(path)
    source = tilted_series.headers[0]
    assert ds.SOPClassUID == pydicom.uid.EncapsulatedSTLStorage and ds.Modality == "M3D"
    assert ds.FrameOfReferenceUID == source.FrameOfReferenceUID and ds.StudyInstanceUID == source.StudyInstanceUID
    assert ds.MIMETypeOfEncapsulatedDocument == "model/stl"
    assert ds.MeasurementUnitsCodeSequence[0].CodeValue == "mm"
    assert [item.ReferencedSOPInstanceUID for item in ds.SourceInstanceSequence] == [
        h.SOPInstanceUID for h in tilted_series.headers
    ]
    back = trimesh.load(io.BytesIO(bytes(ds.EncapsulatedDocument)[: ds.EncapsulatedDocumentLength]), file_type="stl")
    assert np.allclose(np.sort(back.vertices, axis=0), np.sort(mesh.vertices, axis=0), atol=1e-4)


def test_generate_on_a_ct_series_writes_seg_and_stl_that_land_on_its_bone(tiny_implant_models, tmp_path):
    """A defective skull of the test split as a CT series (a folder of DICOM files) through generate_case."""
    import pydicom
    import trimesh
    from scipy.ndimage import binary_dilation

    from pointforge.data.skulls.prepared import PreparedDataset

    root, _, pcdiff, voxelizer = tiny_implant_models
    data = PreparedDataset(root)
    mask = read_volume(data.meta(data.split("test")[0].defective)["source"])
    bone = mask.data.astype(bool)
    corner, mask_mm = np.asarray([-30.0, -40.0, 100.0]), np.asarray(mask.spacing)

    def hounsfield(points: np.ndarray) -> np.ndarray:  # the tests' skull, sampled by a CT with thinner voxels
        index = np.floor((points - corner) / mask_mm).astype(int)
        inside = np.all((index >= 0) & (index < np.asarray(bone.shape)), axis=-1)
        index = np.clip(index, 0, np.asarray(bone.shape) - 1)
        return np.where(inside & bone[index[..., 0], index[..., 1], index[..., 2]], 1100.0, -5.0)

    pitch = 2.9  # mm: under the reader's 3 mm, and a small case (80³ voxels)
    count = (np.asarray(bone.shape) * mask_mm / pitch).astype(int)
    positions = [tuple(corner + (0.0, 0.0, k * pitch)) for k in range(count[2])]
    files = ct_slices(hounsfield, positions, size=(int(count[0]), int(count[1])), pixel_mm=(pitch, pitch))
    folder = in_folder(files, tmp_path / "ct")
    out = tmp_path / "case"
    models = load_models(pcdiff, voxelizer, device="cpu")
    report = generate_case(folder, out, models, GenerateOptions(ensemble=2, sampler="ddim", seed=0), preview=False)

    frame = pydicom.dcmread(folder / "IM0000", stop_before_pixels=True).FrameOfReferenceUID
    assert report["dicom"]["frame_of_reference_uid"] == frame
    assert report["outputs"]["seg"] == "implant_seg.dcm" and report["outputs"]["stl_dicom"] == "implant_stl.dcm"
    implant = read_volume(out / "implant.nrrd")
    voxels = implant.voxel_to_physical(np.argwhere(implant.data.astype(bool)))
    seg, points = seg_points(out / "implant_seg.dcm")
    assert seg.FrameOfReferenceUID == frame and len(points) == len(voxels) > 0
    assert nearest_mm(points, voxels).max() < 1e-3, "the SEG is not where implant.nrrd is"
    # The implant lands on the CT's bone: within one voxel of it, and never inside it.
    ct = read_volume(out / "completed_skull.nrrd").data.astype(bool) & ~implant.data.astype(bool)
    ct_bone = implant.voxel_to_physical(np.argwhere(ct))  # the skull read from the CT, on the implant's grid
    gap = nearest_mm(voxels, ct_bone)
    assert gap.min() <= pitch * math.sqrt(3) + 1e-6 and gap.min() > 1e-3, "the implant does not touch the bone"
    stl = pydicom.dcmread(out / "implant_stl.dcm")
    assert stl.FrameOfReferenceUID == frame
    mesh = trimesh.load(io.BytesIO(bytes(stl.EncapsulatedDocument)[: stl.EncapsulatedDocumentLength]), file_type="stl")
    # The mesh is smoothed: its vertices lie within two voxels of an implant voxel's centre (1.8 seen).
    assert nearest_mm(mesh.vertices, voxels).max() <= 2 * pitch
    touching = binary_dilation(implant.data.astype(bool), np.ones((3, 3, 3), bool)) & ct
    assert touching.any(), "no implant voxel is next to the CT's bone"

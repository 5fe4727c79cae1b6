"""Small synthetic CT series written by pydicom, for the DICOM tests (reader, writers, uploads).

A series is given by a function of position: ``hounsfield_at(points)`` maps
``[..., 3]`` LPS millimetres to HU, so a tilted or unevenly spaced stack samples
the same anatomy as an axial one and a test can compare both with the truth.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def ct_slices(
    hounsfield: Callable[[np.ndarray], np.ndarray],
    positions: Sequence[Sequence[float]],
    *,
    size: tuple[int, int],
    pixel_mm: tuple[float, float] = (1.0, 1.0),
    orientation: Sequence[float] = AXIAL,
    modality: str = "CT",
    rescale: bool = True,
) -> list[bytes]:
    """One CT file per position (stored value = HU + 1024, ``size`` = (columns, rows), ``pixel_mm`` = (column step,
    row step)), sampling ``hounsfield`` at each pixel's centre; the files come in reverse order."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    series, study, frame = generate_uid(), generate_uid(), generate_uid()
    along_row, down_col = np.asarray(orientation[:3], float), np.asarray(orientation[3:], float)
    i, j = np.meshgrid(np.arange(size[0]), np.arange(size[1]), indexing="ij")
    files = []
    for k, position in enumerate(positions):
        points = (
            np.asarray(position, float) + i[..., None] * pixel_mm[0] * along_row + j[..., None] * pixel_mm[1] * down_col
        )
        values = np.asarray(hounsfield(points), np.float32)
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = CTImageStorage, generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.Modality, ds.SeriesInstanceUID, ds.StudyInstanceUID = modality, series, study
        ds.FrameOfReferenceUID, ds.PatientName, ds.PatientID = frame, "Synthetic^Skull", "PF-TEST"
        ds.InstanceNumber = k + 1
        ds.Rows, ds.Columns = size[1], size[0]
        ds.PixelSpacing = [pixel_mm[1], pixel_mm[0]]
        ds.SliceThickness = 1.0
        ds.ImageOrientationPatient = [float(v) for v in orientation]
        ds.ImagePositionPatient = [float(v) for v in position]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        if rescale:
            ds.RescaleSlope, ds.RescaleIntercept = 1, -1024
        ds.PixelData = np.clip(values.T + 1024, 0, 65535).astype(np.uint16).tobytes()
        body = io.BytesIO()
        ds.save_as(body, enforce_file_format=True)
        files.append(body.getvalue())
    return files[::-1]  # the reader must sort them by position, not by order


def zipped(files: Sequence[bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for n, body in enumerate(files):
            archive.writestr(f"series/IM{n:04d}.dcm", body)
        archive.writestr("README.txt", "not a DICOM file")
    return out.getvalue()


def in_folder(files: Sequence[bytes], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n, body in enumerate(files):
        (folder / f"IM{n:04d}").write_bytes(body)
    return folder


def ct_series_zip(hounsfield: np.ndarray, spacing=(0.8, 0.8, 1.6), *, modality: str = "CT") -> bytes:
    """``hounsfield[col, row, slice]`` as one axial CT series starting at (-10, -20, 5) mm, zipped."""
    positions = [(-10.0, -20.0, 5.0 + k * spacing[2]) for k in range(hounsfield.shape[2])]
    planes = iter(range(hounsfield.shape[2]))

    def slice_values(points: np.ndarray) -> np.ndarray:
        return hounsfield[:, :, next(planes)]

    files = ct_slices(
        slice_values, positions, size=hounsfield.shape[:2], pixel_mm=(spacing[0], spacing[1]), modality=modality
    )
    return zipped(files)


def shell_hounsfield(centre: Sequence[float], radius: float, thickness: float) -> Callable[[np.ndarray], np.ndarray]:
    """A bone shell (1200 HU) of outer ``radius`` mm in soft tissue (20 HU): HU as a function of LPS position."""

    def at(points: np.ndarray) -> np.ndarray:
        distance = np.linalg.norm(points - np.asarray(centre, float), axis=-1)
        return np.where((distance <= radius) & (distance >= radius - thickness), 1200.0, 20.0)

    return at


def seg_points(path) -> tuple[object, np.ndarray]:
    """The SEG read back with highdicom, and the LPS position of every foreground pixel from its frame's geometry."""
    import highdicom as hd

    seg = hd.seg.segread(path)
    shared = seg.SharedFunctionalGroupsSequence[0]
    orientation = np.asarray(shared.PlaneOrientationSequence[0].ImageOrientationPatient, float)
    row_mm, col_mm = (float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing)
    frames = seg.pixel_array  # [frame, row, column]
    points = []
    for frame, group in zip(frames, seg.PerFrameFunctionalGroupsSequence):
        position = np.asarray(group.PlanePositionSequence[0].ImagePositionPatient, float)
        rows, cols = np.nonzero(frame)
        points.append(position + np.outer(cols * col_mm, orientation[:3]) + np.outer(rows * row_mm, orientation[3:]))
    return seg, np.concatenate(points)


def nearest_mm(points: np.ndarray, targets: np.ndarray) -> np.ndarray:
    from scipy.spatial import cKDTree

    return cKDTree(targets).query(points)[0]

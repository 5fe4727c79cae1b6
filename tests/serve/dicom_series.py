"""A small synthetic CT series as a zip of DICOM files (pydicom writes them), for the upload tests."""

from __future__ import annotations

import io
import zipfile

import numpy as np


def ct_series_zip(hounsfield: np.ndarray, spacing=(0.8, 0.8, 1.6), *, modality: str = "CT") -> bytes:
    """``hounsfield[col, row, slice]`` as one axial CT series (stored value = HU + 1024), zipped."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    series = generate_uid()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for k in range(hounsfield.shape[2]):
            meta = FileMetaDataset()
            meta.MediaStorageSOPClassUID = CTImageStorage
            meta.MediaStorageSOPInstanceUID = generate_uid()
            meta.TransferSyntaxUID = ExplicitVRLittleEndian
            ds = Dataset()
            ds.file_meta = meta
            ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
            ds.Modality, ds.SeriesInstanceUID, ds.StudyInstanceUID = modality, series, series
            ds.Rows, ds.Columns = hounsfield.shape[1], hounsfield.shape[0]
            ds.PixelSpacing = [spacing[1], spacing[0]]
            ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
            ds.ImagePositionPatient = [-10.0, -20.0, 5.0 + k * spacing[2]]
            ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
            ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
            ds.RescaleSlope, ds.RescaleIntercept = 1, -1024
            ds.PixelData = (hounsfield[:, :, k].T + 1024).astype(np.uint16).tobytes()
            body = io.BytesIO()
            ds.save_as(body, enforce_file_format=True)
            # slices in reverse order: the reader must sort them by position, not by name
            archive.writestr(f"series/IM{hounsfield.shape[2] - k:04d}.dcm", body.getvalue())
        archive.writestr("README.txt", "not a DICOM file")
    return out.getvalue()

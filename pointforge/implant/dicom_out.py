"""A case that came in as a CT series goes back out as DICOM, in the CT's Frame of Reference.

* :func:`write_segmentation`: the implant as a binary **DICOM Segmentation**
  (highdicom), one segment ("Implant", SNOMED CT 40388003), on the grid the
  implant was made on (the skull's isotropic grid: the CT's own for isotropic
  axial series, otherwise resampled, see :mod:`pointforge.data.dicom`); each
  frame carries its position and orientation, the series references the CT
  series' instances and shares its Study, Patient and Frame of Reference UID;
* :func:`write_encapsulated_stl`: the mesh as an **Encapsulated STL** instance
  (DICOM Supplement 205, modality M3D), its vertices in the Frame of
  Reference's patient coordinates (LPS, mm) and the source CT instances listed.

Neither claims more: the Segmentation is a computed, unreviewed proposal
(SegmentAlgorithmType AUTOMATIC) and the STL is the mesh of implant.stl as it is.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pointforge import __version__
from pointforge.atomic import atomic_path
from pointforge.data.volumes import Volume

__all__ = ["write_segmentation", "write_encapsulated_stl", "SEG_FILE", "STL_DICOM_FILE"]

SEG_FILE = "implant_seg.dcm"
STL_DICOM_FILE = "implant_stl.dcm"
_MANUFACTURER = "pointforge"
# Type 2 in the Patient and General Study modules: present, possibly empty. Anonymised series often drop them;
# the new instances carry them empty rather than refusing.
_TYPE2 = (
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "StudyDate",
    "StudyTime",
    "StudyID",
    "AccessionNumber",
    "ReferringPhysicianName",
)


def _with_type2(sources: Sequence[Any], slice_mm: float | None = None) -> list:
    """Copies of the source headers with the Patient and Study type 2 attributes present (empty where absent),
    and a SliceThickness (highdicom reads it; the SEG's own measures are given) where a series has none."""
    import copy

    completed = []
    for source in sources:
        item = copy.copy(source)
        for keyword in _TYPE2:
            if keyword not in item:
                setattr(item, keyword, "")
        if slice_mm is not None and not item.get("SliceThickness"):
            item.SliceThickness = slice_mm
        completed.append(item)
    return completed


def _geometry(implant: Volume) -> dict[str, Any]:
    import highdicom as hd

    direction = np.asarray(implant.direction, dtype=np.float64)
    spacing = [float(s) for s in implant.spacing]
    corners = implant.voxel_to_physical(
        np.stack([np.zeros(implant.shape[2]), np.zeros(implant.shape[2]), np.arange(implant.shape[2])], axis=1)
    )
    return {
        "pixel_measures": hd.PixelMeasuresSequence(
            pixel_spacing=(spacing[1], spacing[0]), slice_thickness=spacing[2], spacing_between_slices=spacing[2]
        ),
        "plane_orientation": hd.PlaneOrientationSequence(
            coordinate_system="PATIENT", image_orientation=(*direction[:, 0], *direction[:, 1])
        ),
        "plane_positions": [hd.PlanePositionSequence("PATIENT", tuple(float(v) for v in c)) for c in corners],
    }


def write_segmentation(path: Path, implant: Volume, sources: Sequence[Any], *, description: str) -> Path:
    """The bool ``implant`` (on a grid in the sources' Frame of Reference) as a DICOM Segmentation at ``path``."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    segment = hd.seg.SegmentDescription(
        segment_number=1,
        segment_label="Implant",
        segmented_property_category=codes.SCT.PhysicalObject,
        segmented_property_type=codes.SCT.Implant,
        algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
        algorithm_identification=hd.AlgorithmIdentificationSequence(
            name="pointforge PCDiff", version=__version__, family=codes.cid7162.ArtificialIntelligence
        ),
    )
    frames = np.ascontiguousarray(np.asarray(implant.data, dtype=bool).transpose(2, 1, 0)).astype(np.uint8)
    seg = hd.seg.Segmentation(
        source_images=_with_type2(sources, float(implant.spacing[2])),
        pixel_array=frames,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=[segment],
        series_instance_uid=hd.UID(),
        series_number=9001,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer=_MANUFACTURER,
        manufacturer_model_name="pointforge generate",
        software_versions=__version__,
        device_serial_number="none",
        series_description=description[:64],
        **_geometry(implant),
    )
    with atomic_path(path, suffix=".dcm") as tmp:
        seg.save_as(tmp)
    return path


def write_encapsulated_stl(path: Path, stl: bytes, sources: Sequence[Any], *, description: str) -> Path:
    """The STL file ``stl`` (vertices in the sources' patient coordinates, mm) as an Encapsulated STL at ``path``."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import EncapsulatedSTLStorage, ExplicitVRLittleEndian, generate_uid

    source = _with_type2(sources[:1])[0]
    now = datetime.datetime.now()
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = EncapsulatedSTLStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.SOPInstanceUID = EncapsulatedSTLStorage, ds.file_meta.MediaStorageSOPInstanceUID
    for keyword in _TYPE2:
        setattr(ds, keyword, source.get(keyword))
    ds.StudyInstanceUID = source.StudyInstanceUID
    ds.Modality, ds.SeriesInstanceUID, ds.SeriesNumber = "M3D", generate_uid(), 9002
    ds.SeriesDescription = description[:64]
    ds.FrameOfReferenceUID = source.FrameOfReferenceUID
    ds.PositionReferenceIndicator = source.get("PositionReferenceIndicator", "")
    ds.Manufacturer, ds.ManufacturerModelName = _MANUFACTURER, "pointforge generate"
    ds.DeviceSerialNumber, ds.SoftwareVersions = "none", __version__
    ds.MeasurementUnitsCodeSequence = [_code("mm", "UCUM", "mm")]
    ds.InstanceNumber = 1
    ds.ContentDate, ds.ContentTime = now.strftime("%Y%m%d"), now.strftime("%H%M%S")
    ds.AcquisitionDateTime = now.strftime("%Y%m%d%H%M%S")
    ds.BurnedInAnnotation = "NO"
    ds.DocumentTitle = description[:64]
    ds.ConceptNameCodeSequence = []
    ds.SourceInstanceSequence = [_reference(s) for s in sources]
    ds.MIMETypeOfEncapsulatedDocument = "model/stl"
    ds.EncapsulatedDocument = stl + (b"\0" if len(stl) % 2 else b"")
    ds.EncapsulatedDocumentLength = len(stl)
    with atomic_path(path, suffix=".dcm") as tmp:
        ds.save_as(tmp, enforce_file_format=True)
    return path


def _code(value: str, scheme: str, meaning: str):
    from pydicom.dataset import Dataset

    item = Dataset()
    item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = value, scheme, meaning
    return item


def _reference(source):
    from pydicom.dataset import Dataset

    item = Dataset()
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = source.SOPClassUID, source.SOPInstanceUID
    return item

"""Defective skull in, implant out: the whole PCDiff pipeline for one case or a dataset.

The stages (surface, sample, voxelize, post-process), each timed, are in
:mod:`pointforge.implant.pipeline`; what one case's folder holds and how it is
written atomically, in :mod:`pointforge.implant.writer`; the dataset driver
(resumable, a failing case never stops the rest) in :mod:`pointforge.implant.folder`.
This module gathers their public names (what ``pointforge generate`` and users import).
"""

from pointforge.devices import resolve_device  # noqa: F401  (this module's name for it before devices.py)
from pointforge.implant.folder import FolderCase, FolderResult, cases_of, generate_folder
from pointforge.implant.pipeline import Generated, GenerateOptions, Models, generate_implant, load_models
from pointforge.implant.writer import REPORT, case_done, generate_case, write_case

__all__ = [
    "GenerateOptions",
    "Models",
    "Generated",
    "load_models",
    "generate_implant",
    "generate_case",
    "generate_folder",
    "REPORT",
    "write_case",
    "case_done",
    "cases_of",
    "FolderCase",
    "FolderResult",
]

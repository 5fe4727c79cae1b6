"""The voxelizer's inference moved to :mod:`pointforge.inference.voxelizer`; this path keeps working.

A plain re-export: the implant layer sits above inference, so importing from
there is no upward import.
"""

from pointforge.inference.voxelizer import (
    LoadedVoxelizer,
    field_to_mesh,
    load_voxelizer,
    points_to_field,
    points_to_volume,
    resample_inside,
    unit_points,
)

__all__ = [
    "LoadedVoxelizer",
    "load_voxelizer",
    "unit_points",
    "points_to_field",
    "points_to_volume",
    "field_to_mesh",
    "resample_inside",
]

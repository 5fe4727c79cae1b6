"""Where a CT series' slices lie, and the stack brought onto an even grid perpendicular to them.

A CT series is a stack of parallel slices, each placed by its own
ImagePositionPatient. Two things real scanners do break the plain "voxel (i, j,
k) = origin + i·row + j·column + k·step·normal" grid:

* **gantry tilt**: the slices stay parallel but each is shifted in its own plane
  (the stack is sheared); the positions show it whatever the tags say;
* **uneven spacing**: a protocol changes slice distance part-way (4 mm through
  the posterior fossa, 7 mm above) or a slice is missing.

:func:`stack_geometry` measures both from the positions and refuses, in one
line, what cannot be made a skull from: a repeated slice or a second stack,
slices further apart than :data:`MAX_SLICE_MM`, or a gap of more than twice the
usual step. :func:`restack` then resamples a mask of the stack (linear
interpolation, threshold 0.5) onto a grid perpendicular to the slices, evenly
spaced at ``step_mm`` and wide enough to hold every shifted slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pointforge.errors import DataError

__all__ = ["MAX_SLICE_MM", "StackGeometry", "stack_geometry", "restack"]

MAX_SLICE_MM = 3.0  # thicker slices lose the shape of a 4-7 mm thick skull at the defect's rim
_EVEN = 0.01  # steps within 1 % of the median: evenly spaced
_GAP = 2.0  # a step over twice the median: slices are missing
_SHIFT_PX = 0.01  # an in-plane shift below a hundredth of a pixel is rounding, not tilt


@dataclass(frozen=True)
class StackGeometry:
    order: np.ndarray  # slice indices, first to last along the normal
    direction: np.ndarray  # 3×3, columns: along a row, down a column, the slice normal (LPS)
    pixel_mm: tuple[float, float]  # (between columns, between rows)
    depth_mm: np.ndarray  # each ordered slice's distance along the normal from the first
    shift_px: np.ndarray  # [n, 2]: each ordered slice's in-plane offset from the first, in pixels (column, row)
    first_position: np.ndarray  # the first ordered slice's ImagePositionPatient

    @property
    def even(self) -> bool:
        steps = np.diff(self.depth_mm)
        return bool(np.abs(steps - np.median(steps)).max() <= _EVEN * np.median(steps))

    @property
    def sheared(self) -> bool:
        return bool(np.abs(self.shift_px).max() > _SHIFT_PX)

    @property
    def tilt_degrees(self) -> float:
        """The stack's shear as an angle (a gantry tilt), measured from the positions."""
        shift_mm = np.hypot(*(self.shift_px[-1] * self.pixel_mm))
        return math.degrees(math.atan2(shift_mm, float(self.depth_mm[-1])))

    @property
    def step_mm(self) -> float:
        return float(np.median(np.diff(self.depth_mm)))


def stack_geometry(orientation, positions, pixel_spacing) -> StackGeometry:
    """The stack's geometry from each slice's ImageOrientationPatient (the first's), positions, PixelSpacing."""
    orientation = np.asarray(orientation, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    row_mm, col_mm = (float(v) for v in pixel_spacing)  # DICOM: between rows, then between columns
    along_row, down_col = orientation[:3], orientation[3:]
    normal = np.cross(along_row, down_col)
    order = np.argsort(positions @ normal, kind="stable")
    placed = positions[order] - positions[order[0]]
    depth = placed @ normal
    _check_steps(np.diff(depth))
    shift = np.stack([placed @ along_row / col_mm, placed @ down_col / row_mm], axis=1)
    direction = np.stack([along_row, down_col, normal], axis=1)
    return StackGeometry(order, direction, (col_mm, row_mm), depth, shift, positions[order[0]])


def _check_steps(steps: np.ndarray) -> None:
    step = float(np.median(steps))
    if steps.min() < 0.05 * max(step, 1e-6):
        raise DataError(
            f"two slices lie {steps.min():.3g} mm apart (a repeated slice or a second stack); "
            "upload one stack of one reconstruction"
        )
    if steps.max() > MAX_SLICE_MM:
        raise DataError(
            f"slices lie up to {steps.max():.3g} mm apart (steps {steps.min():.3g}-{steps.max():.3g} mm); "
            f"an implant needs at most {MAX_SLICE_MM:g} mm: reconstruct thin slices (1 mm or less) and upload those"
        )
    if steps.max() > _GAP * step:
        raise DataError(
            f"a gap of {steps.max():.3g} mm in a stack {step:.3g} mm apart: slices are missing; "
            "upload the complete series"
        )


def _output_box(geometry: StackGeometry, shape: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int]]:
    """The in-plane offset (pixels) of the output grid's first voxel and its size: every shifted slice fits."""
    low = np.floor(geometry.shift_px.min(axis=0) + 1e-6)
    high = np.ceil(geometry.shift_px.max(axis=0) - 1e-6)
    size = (int(shape[0] + high[0] - low[0]), int(shape[1] + high[1] - low[1]))
    return low, size


def restack(mask: np.ndarray, geometry: StackGeometry, step_mm: float) -> tuple[np.ndarray, np.ndarray]:
    """``mask[col, row, slice]`` (slices in ``geometry.order``) on an even, unsheared grid ``step_mm`` apart.

    Returns (the resampled bool mask, its first voxel's position in LPS mm); its
    axes are ``geometry.direction``'s, spacing ``(*geometry.pixel_mm, step_mm)``."""
    from scipy.ndimage import shift as shift_image

    low, size = _output_box(geometry, mask.shape[:2])
    count = int(math.floor(float(geometry.depth_mm[-1]) / step_mm + 1e-6)) + 1
    out = np.zeros((*size, count), dtype=bool)
    for k in range(count):
        depth = k * step_mm
        upper = int(np.clip(np.searchsorted(geometry.depth_mm, depth, side="right"), 1, len(geometry.depth_mm) - 1))
        lower = upper - 1
        span = geometry.depth_mm[upper] - geometry.depth_mm[lower]
        weight = float(np.clip((depth - geometry.depth_mm[lower]) / span, 0.0, 1.0))
        blend = np.zeros(size, dtype=np.float32)
        for index, share in ((lower, 1.0 - weight), (upper, weight)):
            if share <= 0.0:
                continue
            placed = np.zeros(size, dtype=np.float32)
            placed[: mask.shape[0], : mask.shape[1]] = mask[:, :, index]
            offset = geometry.shift_px[index] - low
            blend += share * shift_image(placed, offset, order=1, mode="constant", cval=0.0, prefilter=False)
        out[:, :, k] = blend >= 0.5
    corner = low * np.asarray(geometry.pixel_mm)
    origin = geometry.first_position + geometry.direction[:, :2] @ corner
    return out, origin

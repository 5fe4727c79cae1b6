"""The print-ready implant: the chosen mask grown to a minimum thickness and a margin, closed, measured on the mesh."""

from __future__ import annotations

import numpy as np
import pytest

from pointforge.data.volumes import Volume
from pointforge.errors import ConfigError
from pointforge.implant.printable import PrintOptions, printable_mesh
from tests.helpers import shell_mask


@pytest.fixture(scope="module")
def thin_case() -> tuple[Volume, np.ndarray]:
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


def test_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="margin needs a minimum thickness"):
        PrintOptions(margin_mm=2.0)
    with pytest.raises(ConfigError, match="'vote' or a proposal"):
        PrintOptions(choice="../x")
    with pytest.raises(ConfigError, match="between 0 and 20"):
        PrintOptions(min_thickness_mm=-1)
    assert PrintOptions(choice="1", min_thickness_mm=3, margin_mm=2).slug() == "proposal1-t3mm-m2mm"

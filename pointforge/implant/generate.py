"""Defective skull in, implant out: the whole PCDiff pipeline for one case or a dataset.

Stages (REFERENCE.md, "post-processing"), each timed:

1. **surface** — the defective skull's surface (marching cubes at 0.5, area-uniform
   samples, :func:`~pointforge.data.surface.surface_points`) in voxel-index
   coordinates. A scan with anisotropic voxels (SkullFix) is first resampled to
   isotropic voxels of its finest spacing, as ``pointforge data prepare`` does for
   training; every output is mapped back to the input's grid at the end.
2. **sample** — :func:`~pointforge.inference.pcdiff.complete`: the conditioning
   subsample, the same normalisation as in training, ``n`` implant proposals in
   one batched pass of the chosen sampler, mapped back to voxel coordinates.
3. **voxelize** — per proposal, the voxelizer (Shape-as-Points + DPSR,
   :func:`~pointforge.inference.voxelizer.points_to_volume`) turns a fresh
   subsample of the defective skull's surface plus the proposal's implant points
   into a completed-skull volume. The skull part has ``voxelizer n_points -
   n_implant`` points, so the voxelizer sees as many points as it was trained on.
4. **postprocess** — :func:`~pointforge.implant.postprocess.implant_from_proposals`
   (dilate, majority vote, minus the defective skull, near the generated points,
   opening / largest component / median / closing / hole filling, each sized in
   millimetres as upstream's at 0.45 mm: see that module). Each proposal
   is also turned into an implant on its own (same chain, no vote and no
   dilation): their per-voxel mean is the agreement (uncertainty) map.
5. **write** — into a temporary sibling folder renamed into place at the end, so
   a folder under the final name is always complete (module :func:`generate_case`).

Outputs of one case (``EXT`` is the input's: NRRD in → NRRD out, NIfTI → NIfTI):

* ``implant.EXT`` — bool mask on the input's grid with its exact shape, spacing,
  origin, direction and kept header fields;
* ``implant.stl`` — the implant surface in millimetres in the input's physical
  space (its affine), watertight, normals outward (voxels touching only along an
  edge or a corner are joined by one filled voxel first, so the surface is a
  closed manifold; the report counts them);
* ``proposals/implant_K.EXT`` — each proposal's own implant;
* ``proposals/points.npy`` — the generated implant points, ``[n, P, 3]`` float32
  voxel indices of the input grid;
* ``uncertainty.EXT`` — float32, the fraction of proposals whose implant holds the
  voxel (1 = all agree it is implant, 0 = none; in-between values mark where
  the proposals disagree);
* ``completed_skull.EXT`` — defective skull ∪ implant;
* ``preview.png`` — skull and implant from four surgical views, the implant
  coloured by agreement;
* ``report.json`` — parameters, seed, models, timings per stage, implant volume,
  mesh checks, agreement statistics, versions.

The stages live in :mod:`pointforge.implant.pipeline`, the writing in
:mod:`pointforge.implant.writer`, the dataset driver in
:mod:`pointforge.implant.folder`; this module gathers their public names
(what ``pointforge generate`` and users import).
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

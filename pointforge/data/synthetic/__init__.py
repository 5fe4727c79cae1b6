"""Synthetic SkullBreak- and SkullFix-style skulls with cranial defects.

The real datasets cannot be downloaded everywhere, so tests, the demo and the
benchmarks run on skulls made here; defects follow the five SkullBreak classes.
One module per job, the skull family being the unit:

* :mod:`~pointforge.data.synthetic.domes`: the dome family (plausible, not anatomical; fast tests);
* :mod:`~pointforge.data.synthetic.anatomical`: the anatomical family (a real head,
  fsaverage's, deformed skull to skull), its template read and tabulated by
  :mod:`~pointforge.data.synthetic.fsaverage`;
* :mod:`~pointforge.data.synthetic.defects`: the defect classes, cut from any skull;
* :mod:`~pointforge.data.synthetic.dataset`: :func:`~pointforge.data.synthetic.dataset.synthesize`,
  a dataset folder of one family;
* shared by the families: :mod:`~pointforge.data.synthetic.grid` (voxel grid and
  axis convention), :mod:`~pointforge.data.synthetic.sphere` (directions and smooth
  fields), :mod:`~pointforge.data.synthetic.raster` (a shell to a one-piece volume).
"""

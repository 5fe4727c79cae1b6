"""`pointforge demo`: the whole system on a fresh machine, with no data and no weights.

1. **data** — synthesise a small SkullBreak-style dataset (``skulls`` skulls × 5
   defect classes) and prepare it (surface points, complete masks, a split
   grouped by skull).
2. **train** — PCDiff and the voxelizer side by side, each a torchrun job of
   one process with one thread, for ``minutes`` of wall-clock time
   (``train.max_minutes``), in phases: after each phase the checkpoints are kept
   so the report can show what more training buys (the learning curve).
3. **generate** — implants for every held-out case (test and validation
   splits) with the checkpoints of each phase; the phase with the best
   validation DSC is the one the report is about, so the test cases never choose.
4. **baseline** — the same cases filled with the mean of the registered training
   skulls (:mod:`pointforge.implant.baseline`); the **oracle** feeds the true
   implant points through the same voxelizer and clean-up.
5. **evaluate** — DSC, bDSC and HD95 of all of them against the true implants.
6. **report** — ``report.md`` and ``report.html`` with previews, metrics per case
   and per defect class, the curve, timings, and the commands that reproduce each
   step at full scale on GPUs; ``demo.json`` holds every number.

Every number in the report is computed in this run; nothing is cached. The
output folder must be new or empty (a previous demo is never overwritten).

The modules, one job each: :mod:`.settings` (the settings and the data stage),
:mod:`.training` (the timed phases, through the one torchrun launcher),
:mod:`.scoring` (generation, oracle, baseline, evaluation, the chosen phase),
:mod:`.report` (Markdown, tables, the curve) with :mod:`.report_page` (HTML),
and :mod:`.run` (:func:`~pointforge.implant.demo.run.run_demo`, every stage in
order). It lives in :mod:`pointforge.implant` because it is the implant
pipeline end to end and needs nothing above it (the CLI's ``demo`` command
only parses and prints).
"""

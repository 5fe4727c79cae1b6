"""`pointforge demo`: the whole system on a fresh machine, with no data and no weights.

1. **data** — synthesise a small SkullBreak-style dataset (``skulls`` skulls of
   ``family`` × 5 defect classes; the anatomical family by default) and prepare
   it (surface points, complete masks, a seeded split grouped by skull).
2. **train** — PCDiff and the voxelizer side by side, each a torchrun job of
   one process with one thread, for ``minutes`` of wall-clock time
   (``train.max_minutes``), in phases; each phase's checkpoints are kept.
3. **probe** — every phase's models on the validation cases, generated
   cheaply and scored in memory; the phase with the best validation DSC is
   the one the report is about, so the test cases never choose.
4. **test** — the chosen phase generates the test cases with every output.
5. **oracle** — the true implant points through the same voxelizer and
   clean-up; **baseline** — the defect filled with the mean of the registered
   training skulls (:mod:`pointforge.implant.baseline`).
6. **student** (only with ``--distill``) — the chosen PCDiff distilled
   into a few-step student, its test cases generated and scored the same way,
   and what it cost and changed (:mod:`.student`).
7. **report** — ``report.md`` and ``report.html``: every mean with its 95 %
   bootstrap interval and the paired difference pipeline − baseline ("beats"
   only where its interval excludes zero), tables per case and per defect
   class, the curve, previews, where the time went, and the commands that
   reproduce each step at full scale on GPUs; ``demo.json`` holds every number.

Every number in the report is computed in this run; nothing is cached. The
output folder must be new or empty (a previous demo is never overwritten).

The modules, one job each: :mod:`.budget` (the time budget and the time
split), :mod:`.settings` (the settings and the data stage), :mod:`.training`
(the timed phases, through the one torchrun launcher), :mod:`.workers` (the
per-case work on one-thread worker processes), :mod:`.scoring` (probe, test,
oracle, baseline, the chosen phase), :mod:`.student` (the few-step
student), :mod:`.verdict` (intervals and the verdict), :mod:`.report` (Markdown, the curve) with :mod:`.report_tables` and
:mod:`.report_page` (HTML), and :mod:`.run`
(:func:`~pointforge.implant.demo.run.run_demo`, every stage in order). It
lives in :mod:`pointforge.implant` because it is the implant pipeline end to
end and needs nothing above it (the CLI's ``demo`` command only parses and
prints).
"""

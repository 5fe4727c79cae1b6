"""The demo's time budget, in one place: how much of its wall time goes to training, and where the rest goes.

`make demo` must finish in about ten minutes on 2 CPU cores, and training is
what makes the result, so every other stage is sized to cost little:

* **phases**: the models are saved at ¼, ½ and all of the training budget
  (the learning curve, and the choice against over-fitting);
* **probe**: each phase is scored on the validation cases only, with a cheap
  generation (:data:`PROBE_ENSEMBLE` proposals, :data:`PROBE_STEPS` sampler
  steps) and nothing written but the scores; the phase with the best
  validation DSC is chosen;
* **full scoring** only for the chosen phase, on the test cases: every
  output (implant, mesh, preview, 3-D view) with the demo's ensemble and
  sampler, then the oracle (true implant points through the chosen voxelizer,
  scored in memory) and the baseline.

On 2 cores the parts other than training take about 4 minutes at the default
sizes (16 skulls, 20 test and 10 validation cases; docs/experiments/implant.md);
:data:`DEFAULT_MINUTES` of training fills the rest of the ten. :class:`TimeSplit` records where the wall time actually
went (data, training, generating, scoring, report) for the report.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# Training minutes of `pointforge demo` / `make demo` (PCDiff and the voxelizer side by side).
DEFAULT_MINUTES = 5.0
# The default data: 16 skulls split 10 / 2 / 4 by skull (training, validation, test),
# so 20 test cases from 4 skulls and 10 validation cases from 2.
DEFAULT_SKULLS = 16
DEFAULT_SPLIT = "0.625,0.125,0.25"
# Fractions of the training budget after which the models are kept and probed.
PHASES = (0.25, 0.5, 1.0)
# The probe of each phase: the validation cases (at most this many), generated cheaply.
PROBE_CASES = 10
PROBE_ENSEMBLE = 2
PROBE_STEPS = 10

KINDS = ("data", "training", "generating", "scoring", "report")


@dataclass
class TimeSplit:
    """Wall-clock seconds by kind of work (:data:`KINDS`), summed over the demo's stages."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def add(self, kind: str, seconds: float) -> None:
        if kind not in self.seconds:
            raise ValueError(f"unknown kind of work {kind!r}; one of {', '.join(KINDS)}")
        self.seconds[kind] += seconds

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - start)

    def table(self, total: float) -> dict[str, float]:
        """Seconds by kind, rounded, with ``other`` (what no kind claimed: start-up, loading) and ``total``."""
        rounded = {k: round(v, 1) for k, v in self.seconds.items()}
        return {**rounded, "other": round(max(total - sum(self.seconds.values()), 0.0), 1), "total": round(total, 1)}

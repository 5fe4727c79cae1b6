"""`pointforge demo`: the system end to end on a fresh machine, with no data and no weights.

What exists today runs for real: synthesise a small SkullBreak-style dataset,
prepare it into surface point clouds with a grouped split, print a summary and
write a preview of one skull with its defect and implant. Training, implant
generation and evaluation join this function as those parts land.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pointforge.data.prepare import atomic_write_text, prepare_dataset
from pointforge.data.volumes import read_binary_volume


@dataclass
class DemoResult:
    out: Path
    skulls: int
    size: int
    cases: int
    points_per_surface: int
    split_counts: dict
    preview: Path
    timings: dict = field(default_factory=dict)


def run_demo(out: str | Path = "demo_out", *, skulls: int = 6, size: int = 128, seed: int = 0,
             points: int = 30_000, workers: int | None = None, log=print, progress=None) -> DemoResult:
    """Run the demo into ``out``; ``log`` receives one line per stage."""
    from pointforge.data.synthetic import synthesize
    from pointforge.implant.export import skull_preview

    out = Path(out)
    raw, prepared = out / "raw", out / "prepared"
    timings = {}

    t = time.perf_counter()
    log(f"[1/3] synthesising {skulls} SkullBreak-style skulls at {size}³ (5 defect classes each) → {raw}")
    synthesize(raw, skulls, size, seed, layout="skullbreak")
    timings["synthesise_s"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"[2/3] preparing surface point clouds ({points} points per surface) → {prepared}")
    result = prepare_dataset(raw, prepared, n_points=points, seed=seed, workers=workers, progress=progress)
    timings["prepare_s"] = time.perf_counter() - t
    if result.failures:
        raise RuntimeError("prepare failed on synthetic data: " + "; ".join(result.failures))

    t = time.perf_counter()
    case = next(c for c in result.cases if c.split == "test" and c.defect == "frontoorbital") if any(
        c.split == "test" and c.defect == "frontoorbital" for c in result.cases) else result.cases[0]
    defective = read_binary_volume(raw / "defective_skull" / case.defect / f"{case.skull_id}.nrrd")
    implant = read_binary_volume(raw / "implant" / case.defect / f"{case.skull_id}.nrrd")
    preview = skull_preview(out / "preview.png", defective.data, implant.data, defective.spacing,
                            title=f"synthetic skull {case.skull_id}: {case.defect} defect (orange = implant)")
    timings["preview_s"] = time.perf_counter() - t
    log(f"[3/3] preview of {case.case_id} → {preview}")

    demo = DemoResult(out=out, skulls=skulls, size=size, cases=len(result.cases), points_per_surface=points,
                      split_counts=result.split_counts, preview=preview,
                      timings={k: round(v, 2) for k, v in timings.items()})
    atomic_write_text(out / "summary.json", json.dumps(asdict(demo), default=str, indent=1))
    return demo

"""The implant pipeline end to end: seconds per stage and per implant, and quality per sampler and ensemble size.

Every measurement calls :func:`pointforge.implant.pipeline.generate_implant` (what
``pointforge generate`` runs, minus writing files) on the held-out (test split)
cases of a prepared dataset, with one seed for every configuration:

* **ensemble size** — DDIM 7 steps (``pointforge generate``'s default) with
  n = 1, 3 and 5 proposals;
* **sampler** — with n = 5: DDPM over all T steps of the model's schedule, DDIM
  at 100/50/25/10/7/5 steps, DPM-Solver++(2M) at 20/10 steps (step counts are
  capped at the model's T, and configurations that become the same run once);
* **baseline** — the defect filled with the mean registered training skull
  (:mod:`pointforge.implant.baseline`, its atlas built from the train split),
  on the same cases, as the reference row.

Per case, each configuration's row holds the seconds of every stage: **read**
(the defective skull's volume from disk), **surface**, **sample**, **voxelize**
and **postprocess** (``Generated.timings``; generate.py's docstring says what
each does) and **end to end** (read + ``generate_implant``, i.e. everything but
writing the outputs), plus DSC, bDSC (10 mm margin) and HD95 against the true
implant (:func:`pointforge.implant.metrics.evaluate_case`). A case that yields
no implant (``generate_implant`` raises DataError: the proposals fall outside
the volume, or nothing survives post-processing) counts as DSC 0 and bDSC 0
and is listed as failed; its HD95 is undefined and left out of the HD95 mean,
which is therefore over the successful cases only (the column says how many).
A failed case's stages up to the failure are timed from the moments
``generate_implant`` logs each finished stage. Before anything is timed, one
throw-away call on the first case warms up the lazy initialisations.

How to read it. The stage table is CPU seconds per case with ``--threads``
torch threads (default 1: on a shared 2-core machine the small networks are
dispatch-bound and a second thread only adds contention; ``--compare-threads
2`` times n = 1/3/5 on the first case with both counts, side by side, to check
that here). NumPy/SciPy work (surface, postprocess) is not governed by that
setting. On a shared machine wall times wander with the load: the record holds
the load average at start and end, and the "s / step" column (sample seconds
over sampler steps) should stay about constant across samplers at one n. Quality
numbers are only as good as the models: undertrained ones fail every case, and
with 5-10 test cases one case moves the mean DSC by 0.1-0.2, so compare rows of
one run, not runs.

GPU. When ``torch.cuda.is_available()`` (and not ``--no-gpu``) the ensemble-size
configurations are timed again with the models on ``cuda`` (one warm-up call
first; ``generate_implant`` returns NumPy arrays, so its stage times include
the device synchronisation). THAT BRANCH HAS NOT BEEN RUN: it was written on a
machine without a GPU. The paper-preset goal (n = 5 ≤ 60 s end to end on an
H100, against ≈1,140 s for upstream on an A100) is about paper-preset
checkpoints on SkullBreak-sized volumes; give them with ``--pcdiff``,
``--voxelizer`` and ``--data``. With the demo's tiny models the GPU numbers say
little about that goal.

Inputs, one of:

* ``--demo DIR`` — an existing ``pointforge demo`` output: the checkpoints
  its report is about (the phase chosen on the validation cases, from
  ``DIR/demo.json``; without one, the newest ``DIR/checkpoints/pcdiff-*.pt``
  and ``voxelizer-*.pt`` by their minutes) and ``DIR/data/prepared``;
* ``--pcdiff CK --voxelizer CK --data PREPARED`` — any trained pair and a
  prepared dataset (its cases record their raw volumes);
* nothing — the demo is run first with its default settings into a new
  temporary folder (about 10 minutes on 2 cores), which is kept and printed so
  the next run can pass it as ``--demo``.

Work: ``--cases N`` takes the first N test cases; ``--quick`` runs fewer
configurations (n = 1 and 5 at DDIM 7, DDIM 50 and DPM++ 10 at n = 5) for a
smoke run. The full default on the demo's 10 test cases is 11 configurations ×
10 cases, about 50 minutes on 2 shared cores with a tiny T = 1000 PCDiff
(n = 5 costs about 0.2 s per sampler step, so DDPM-1000 alone is about 200 s
per case); ``--quick`` on the same 10 cases took 4 minutes (with DDIM 10 then).

Output: the tables below, and ``bench/results/pipeline.json`` with the machine,
threads, load averages, the models (``Models.describe()``), the cases and every
configuration's per-case rows.

    python bench/pipeline.py [--demo DIR | --pcdiff CK --voxelizer CK --data PREPARED]
                             [--cases N] [--quick] [--threads 1] [--compare-threads 2]
                             [--seed 0] [--no-gpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from _common import machine, print_table, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pointforge.data.skulls.prepared import PreparedDataset  # noqa: E402
from pointforge.data.volumes import Volume, read_binary_volume  # noqa: E402
from pointforge.errors import DataError, UserError  # noqa: E402
from pointforge.formats import json_safe  # noqa: E402
from pointforge.implant.metrics import evaluate_case  # noqa: E402
from pointforge.implant.models import Models, load_models  # noqa: E402
from pointforge.implant.options import GenerateOptions  # noqa: E402
from pointforge.implant.pipeline import generate_implant  # noqa: E402
from pointforge.implant.proposals import GENERATE_STEPS  # noqa: E402
from pointforge.nn.diffusion.samplers.registry import make_sampler  # noqa: E402

STAGES = ("read", "surface", "sample", "voxelize", "postprocess")
DEFAULT = ("ddim", GENERATE_STEPS["ddim"])  # pointforge generate's default sampler
ENSEMBLES = (1, 3, 5)
SAMPLERS = (
    ("ddpm", None),
    ("ddim", 100),
    ("ddim", 50),
    ("ddim", 25),
    ("ddim", 10),
    ("ddim", 7),
    ("ddim", 5),
    ("dpm++2m", 20),
    ("dpm++2m", 10),
)
QUICK_ENSEMBLES = (1, 5)
QUICK_SAMPLERS = (("ddim", 50), ("ddim", 7), ("dpm++2m", 10))
SWEEP_N = 5
PAPER_GOAL_S = 60.0  # n = 5, end to end, paper preset, one H100
UPSTREAM_A100_S = 1140.0


# --------------------------------------------------------------------------- inputs


def newest_checkpoint(folder: Path, task: str) -> Path:
    """The demo's ``<task>-<minutes>min.pt`` with the most minutes (by number, not by name)."""
    found = []
    for path in folder.glob(f"{task}-*.pt"):
        match = re.fullmatch(rf"{re.escape(task)}-([0-9.]+)min\.pt", path.name)
        if match:
            found.append((float(match.group(1)), path))
    if not found:
        raise SystemExit(f"{folder}: no {task}-<minutes>min.pt checkpoint; is this a `pointforge demo` output folder?")
    return max(found)[1]


def demo_checkpoint(demo: Path, task: str) -> Path:
    """The checkpoint of the phase the demo's report chose (``demo.json``), else the newest."""
    try:
        summary = json.loads((demo / "demo.json").read_text())
        minutes = float(summary["phases"][summary["chosen"]]["minutes"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return newest_checkpoint(demo / "checkpoints", task)
    path = demo / "checkpoints" / f"{task}-{minutes:.2f}min.pt"
    return path if path.is_file() else newest_checkpoint(demo / "checkpoints", task)


def resolve_inputs(args: argparse.Namespace) -> tuple[Path, Path, Path, str]:
    """(pcdiff checkpoint, voxelizer checkpoint, prepared dataset, where they came from)."""
    explicit = [args.pcdiff, args.voxelizer, args.data]
    if args.demo is not None and any(v is not None for v in explicit):
        raise SystemExit("give either --demo DIR or --pcdiff/--voxelizer/--data, not both")
    if any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            raise SystemExit("--pcdiff, --voxelizer and --data go together; give all three (or --demo DIR)")
        return args.pcdiff, args.voxelizer, args.data, "given checkpoints"
    demo = args.demo
    if demo is None:
        from pointforge.implant.demo.run import run_demo

        demo = Path(tempfile.mkdtemp(prefix="pipeline-bench-demo-"))
        print(
            f"no models given: running `pointforge demo` with its default settings into {demo} "
            "(about 10 minutes on 2 cores) ...",
            flush=True,
        )
        run_demo(demo, log=lambda msg: print(f"  {msg}", flush=True))
        print(f"demo done; next time pass --demo {demo}", flush=True)
    if not demo.is_dir():
        raise SystemExit(f"--demo {demo}: no such folder")
    data = demo / "data" / "prepared"
    if not (data / "cases.csv").is_file():
        raise SystemExit(f"{demo}: no prepared dataset at data/prepared; is this a `pointforge demo` output folder?")
    return (
        demo_checkpoint(demo, "pcdiff"),
        demo_checkpoint(demo, "voxelizer"),
        data,
        f"demo output {demo}",
    )


@dataclass
class Case:
    case_id: str
    defect: str
    defective: Path  # the raw defective-skull volume
    truth: Volume  # the true implant, read once (not timed)


def held_out_cases(data_root: Path, limit: int | None) -> list[Case]:
    data = PreparedDataset(data_root)
    chosen = data.split("test", require=("defective", "implant"))
    if not chosen:
        raise SystemExit(f"{data_root}: the prepared dataset has no test case with a defective skull and an implant")
    cases = []
    for case in chosen[:limit]:
        sources = [data.meta(rel).get("source") for rel in (case.defective, case.implant)]
        if not all(sources) or not all(Path(s).is_file() for s in sources):
            raise SystemExit(
                f"{data_root}: case {case.case_id} does not point at its raw volumes ({sources}); re-run prepare"
            )
        cases.append(
            Case(case.case_id, case.defect, Path(sources[0]), read_binary_volume(sources[1], allow_empty=True))
        )
    return cases


# --------------------------------------------------------------------------- one case, one configuration


def options_for(sampler: str, steps: int | None, n: int, seed: int) -> GenerateOptions:
    return GenerateOptions(ensemble=n, sampler=sampler, steps=steps, seed=seed)


def fit_steps(models: Models, steps: int | None) -> int | None:
    """A requested step count capped at the model's T (a short-schedule model has fewer steps to skip over)."""
    return None if steps is None else min(steps, models.pcdiff.config.diffusion.timesteps)


def sampler_steps(models: Models, sampler: str, steps: int | None) -> int:
    """The number of model calls the sampler makes (dpm++2m's quadratic spacing may merge a few)."""
    return make_sampler(sampler, fit_steps(models, steps), schedule=models.pcdiff.schedule).num_steps


def score(pred: np.ndarray | None, case: Case, defective: Volume) -> dict:
    """DSC, bDSC, HD95 (mm); a failed case (no implant) is DSC 0, bDSC 0, HD95 undefined."""
    if pred is None:
        return {"dsc": 0.0, "bdsc": 0.0, "hd95": math.nan, "metric_notes": "failed: counted as DSC 0, bDSC 0"}
    found = evaluate_case(pred, case.truth.data, defective.data, case.truth.spacing)
    if found["error"]:
        raise SystemExit(f"case {case.case_id}: cannot score the implant: {found['error']}")
    return {
        "dsc": found["dsc"],
        "bdsc": found["bdsc"],
        "hd95": found["hd95"],
        "metric_notes": "; ".join(found["notes"]),
    }


def run_case(case: Case, models: Models, options: GenerateOptions) -> dict:
    """One ``generate_implant`` call, timed per stage and scored; DataError → a failed row."""
    marks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    defective = read_binary_volume(case.defective)
    read_s = time.perf_counter() - t0
    marks.append(("read", time.perf_counter()))
    error, pred, notes, timings = None, None, [], {"read_s": read_s}
    try:
        result = generate_implant(
            defective, models, options, log=lambda msg: marks.append((msg.split(":", 1)[0], time.perf_counter()))
        )
        total = time.perf_counter() - t0
        timings.update(result.timings)
        pred, notes = result.implant, result.notes
    except DataError as err:
        total = time.perf_counter() - t0
        error = str(err).strip().splitlines()[0]
        # the stages that finished before the failure, from the moments each was logged
        for (_, before), (stage, at) in zip(marks, marks[1:]):
            if stage in STAGES:
                timings[f"{stage}_s"] = at - before
    timings["total_s"] = total
    row = {
        "case_id": case.case_id,
        "defect": case.defect,
        "ok": error is None,
        "error": error,
        "timings_s": timings,
        "implant_voxels": None if pred is None else int(pred.sum()),
        "notes": notes,
    }
    row.update(score(pred, case, defective))
    return row


def run_config(sampler: str, steps: int | None, n: int, cases: list[Case], models: Models, seed: int) -> dict:
    """One sampler/steps/ensemble configuration over ``cases``; ``steps`` is capped at the model's T."""
    num_steps = sampler_steps(models, sampler, steps)
    label = f"{sampler}-{num_steps}"
    rows = []
    for case in cases:
        row = run_case(case, models, options_for(sampler, fit_steps(models, steps), n, seed))
        rows.append(row)
        outcome = f"DSC {row['dsc']:.3f}" if row["ok"] else f"failed ({row['error'][:70]})"
        print(f"  {label} n={n} {case.case_id}: {row['timings_s']['total_s']:.1f} s, {outcome}", flush=True)
    return {
        "label": label,
        "sampler": sampler,
        "requested_steps": steps,
        "steps": num_steps,
        "ensemble": n,
        "seed": seed,
        "device": str(models.device),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "summary": summarise(rows, num_steps, n),
    }


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


def summarise(rows: list[dict], steps: int | None, n: int | None) -> dict:
    ok = [r for r in rows if r["ok"]]
    out = {
        "cases": len(rows),
        "failed": len(rows) - len(ok),
        "dsc_mean": _mean([r["dsc"] for r in rows]),
        "bdsc_mean": _mean([r["bdsc"] for r in rows]),
        "hd95_mean": _mean([r["hd95"] for r in rows]),
        "hd95_cases": sum(1 for r in rows if math.isfinite(r["hd95"])),
    }
    for stage in (*STAGES, "total"):
        out[f"{stage}_s"] = _mean([r["timings_s"].get(f"{stage}_s") for r in rows])
    out["total_ok_s"] = _mean([r["timings_s"]["total_s"] for r in ok])
    out["sample_s_per_step"] = out["sample_s"] / steps if steps else math.nan
    out["voxelize_s_per_proposal"] = _mean([r["timings_s"].get("voxelize_s") for r in ok]) / n if n else math.nan
    return out


def warm_up(case: Case, models: Models, seed: int) -> None:
    """One untimed call: first-call costs (allocations, kernel selection, imports) stay out of the numbers."""
    steps = min(5, models.pcdiff.config.diffusion.timesteps)
    run_case(case, models, options_for("ddim", steps, 1, seed))


# --------------------------------------------------------------------------- baseline


def run_baseline(data_root: Path, cases: list[Case]) -> dict:
    from pointforge.implant.baseline import Atlas, mean_skull_implant

    t = time.perf_counter()
    atlas = Atlas.from_prepared(data_root, split="train")
    atlas_s = time.perf_counter() - t
    rows = []
    for case in cases:
        t = time.perf_counter()
        defective = read_binary_volume(case.defective)
        implant = mean_skull_implant(defective, atlas).data
        seconds = time.perf_counter() - t
        ok = bool(implant.any())
        row = {
            "case_id": case.case_id,
            "defect": case.defect,
            "ok": ok,
            "error": None if ok else "the baseline implant is empty after cleaning",
            "timings_s": {"total_s": seconds},
            "implant_voxels": int(implant.sum()),
            "notes": [],
        }
        row.update(score(implant if ok else None, case, defective))
        rows.append(row)
        print(f"  baseline {case.case_id}: {seconds:.1f} s, DSC {row['dsc']:.3f}", flush=True)
    return {
        "label": "baseline (mean registered skull)",
        "atlas_skulls": len(atlas),
        "atlas_s": atlas_s,
        "rows": rows,
        "summary": summarise(rows, None, None),
    }


# --------------------------------------------------------------------------- tables


def _f(value: float, digits: int = 2) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def stage_rows(configs: list[dict]) -> list[list[str]]:
    rows = []
    for c in configs:
        s = c["summary"]
        rows.append(
            [
                c["label"],
                c["ensemble"],
                c["steps"],
                *[_f(s[f"{st}_s"]) for st in STAGES],
                _f(s["total_s"]),
                _f(s["sample_s_per_step"], 3),
                _f(s["voxelize_s_per_proposal"]),
                f"{s['failed']}/{s['cases']}",
            ]
        )
    return rows


STAGE_HEADERS = [
    "config",
    "n",
    "steps",
    *[f"{st} s" for st in STAGES],
    "end to end s",
    "s / step",
    "voxelize s / proposal",
    "failed",
]


def quality_rows(configs: list[dict], baseline: dict | None) -> list[list[str]]:
    rows = []
    for c in [*configs, *([baseline] if baseline else [])]:
        s = c["summary"]
        rows.append(
            [
                c["label"],
                c.get("ensemble", "—"),
                c.get("steps", "—"),
                _f(s["dsc_mean"], 3),
                _f(s["bdsc_mean"], 3),
                f"{_f(s['hd95_mean'])} ({s['hd95_cases']})",
                f"{s['failed']}/{s['cases']}",
                _f(s["total_s"]),
            ]
        )
    return rows


QUALITY_HEADERS = [
    "config",
    "n",
    "steps",
    "mean DSC (failed = 0)",
    "mean bDSC (failed = 0)",
    "mean HD95 mm (cases)",
    "failed",
    "s per case",
]


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", type=Path, help="a `pointforge demo` output folder (its final checkpoints and data)")
    parser.add_argument("--pcdiff", type=Path, help="a PCDiff checkpoint (with --voxelizer and --data)")
    parser.add_argument("--voxelizer", type=Path, help="a voxelizer checkpoint")
    parser.add_argument("--data", type=Path, help="a prepared dataset whose test split is generated")
    parser.add_argument("--cases", type=int, help="the first N test cases only (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer configurations, for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument(
        "--compare-threads",
        type=int,
        metavar="T",
        help="also time n = 1/3/5 on the first case with T threads, side by side with --threads",
    )
    parser.add_argument("--seed", type=int, default=0, help="one seed for every configuration")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU timings even when CUDA is available")
    args = parser.parse_args()
    if args.cases is not None and args.cases < 1:
        raise SystemExit(f"--cases must be at least 1, got {args.cases}")
    if args.threads < 1 or (args.compare_threads is not None and args.compare_threads < 1):
        raise SystemExit("--threads and --compare-threads must be at least 1")
    return args


def sweep(cases, models, args) -> list[dict]:
    """Ensemble sizes at the default sampler, then every sampler at n = SWEEP_N; a configuration met twice runs once."""
    configs: list[dict] = []
    done: dict[tuple[str, int, int], dict] = {}

    def config(sampler: str, steps: int | None, n: int, group: str) -> dict:
        key = (sampler, sampler_steps(models, sampler, steps), n)
        if key not in done:  # e.g. ddim-100 and ddim-50 are both ddim-20 for a T = 20 model
            done[key] = run_config(sampler, steps, n, cases, models, args.seed)
            configs.append(done[key])
        done[key].setdefault("groups", []).append(group)
        return done[key]

    print("\nensemble size at the default sampler (CPU):", flush=True)
    for n in QUICK_ENSEMBLES if args.quick else ENSEMBLES:
        config(*DEFAULT, n, "ensemble size")
    print(f"\nsamplers at n = {SWEEP_N} (CPU):", flush=True)
    for name, steps in QUICK_SAMPLERS if args.quick else SAMPLERS:
        config(name, steps, SWEEP_N, "sampler")
    return configs


def compare_threads(cases, models, args) -> list[dict]:
    threads_cmp = []
    print(f"\nthreads {args.threads} vs {args.compare_threads} on {cases[0].case_id}:", flush=True)
    for threads in sorted({args.threads, args.compare_threads}):
        torch.set_num_threads(threads)
        warm_up(cases[0], models, args.seed)
        for n in QUICK_ENSEMBLES if args.quick else ENSEMBLES:
            threads_cmp.append(run_config(*DEFAULT, n, cases[:1], models, args.seed))
    torch.set_num_threads(args.threads)
    return threads_cmp


def gpu_timings(pcdiff, voxelizer, cases, args) -> dict:
    gpu_models = load_models(pcdiff, voxelizer, device="cuda")
    print(f"\nGPU ({torch.cuda.get_device_name(gpu_models.device)}), ensemble size at the default sampler:", flush=True)
    warm_up(cases[0], gpu_models, args.seed)
    torch.cuda.reset_peak_memory_stats(gpu_models.device)
    gpu = {
        "device": torch.cuda.get_device_name(gpu_models.device),
        "configs": [
            run_config(*DEFAULT, n, cases, gpu_models, args.seed)
            for n in (QUICK_ENSEMBLES if args.quick else ENSEMBLES)
        ],
    }
    gpu["peak_memory_gib"] = torch.cuda.max_memory_allocated(gpu_models.device) / 2**30
    return gpu


def print_results(record: dict, cases, args, cfg) -> None:
    configs, baseline, threads_cmp, gpu = (
        record["configs"],
        record["baseline"],
        record["threads_comparison"],
        record["gpu"],
    )
    print(
        f"\nstage seconds per case, mean over {len(cases)} case(s) (CPU, {args.threads} thread(s); "
        "failed cases: stages finished before the failure):"
    )
    print_table(STAGE_HEADERS, stage_rows(configs))
    print(
        f"\nquality over {len(cases)} held-out case(s), seed {args.seed} (HD95 over the successful cases; "
        f"baseline atlas: {baseline['atlas_skulls']} training skulls, built in {baseline['atlas_s']:.1f} s):"
    )
    print_table(QUALITY_HEADERS, quality_rows(configs, baseline))
    if threads_cmp:
        print(f"\ntorch threads, {cases[0].case_id}, {threads_cmp[0]['label']} (one run each):")
        print_table(
            ["threads", "n", "surface s", "sample s", "voxelize s", "postprocess s", "end to end s"],
            [
                [
                    c["threads"],
                    c["ensemble"],
                    *[_f(c["summary"][f"{st}_s"]) for st in ("surface", "sample", "voxelize", "postprocess", "total")],
                ]
                for c in threads_cmp
            ],
        )
    if gpu:
        print(f"\nGPU {gpu['device']} (peak {gpu['peak_memory_gib']:.2f} GiB):")
        print_table(STAGE_HEADERS, stage_rows(gpu["configs"]))
        five = [c for c in gpu["configs"] if c["ensemble"] == 5]
        if five:
            print(
                f"n = 5 end to end: {_f(five[0]['summary']['total_s'], 1)} s per case; the goal is ≤ {PAPER_GOAL_S:.0f} s "
                f"with paper-preset models on an H100 (upstream ≈ {UPSTREAM_A100_S:.0f} s on an A100); "
                f"these models: PCDiff preset {cfg.model}"
            )
    print(
        f"\nload average {record['load_average_start'][0]:.2f} at start, {record['load_average_end'][0]:.2f} at end; "
        f"{record['seconds'] / 60:.1f} min in all"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    try:
        pcdiff, voxelizer, data_root, source = resolve_inputs(args)
        cases = held_out_cases(data_root, args.cases)
        models = load_models(pcdiff, voxelizer, device="cpu")
    except UserError as err:  # DataError, CheckpointError, ...: one clear line
        raise SystemExit(f"bench/pipeline.py: {err}")
    record: dict = {
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg(),
        "inputs": source,
        "data": str(data_root),
        "models": models.describe(),
        "seed": args.seed,
        "quick": args.quick,
        "cases": [{"case_id": c.case_id, "defect": c.defect, "defective": str(c.defective)} for c in cases],
    }
    cfg = models.pcdiff.config
    print(f"{machine()}; {torch.get_num_threads()} torch thread(s); load average {os.getloadavg()[0]:.2f}")
    print(
        f"models ({source}): PCDiff {cfg.model} (T = {cfg.diffusion.timesteps}, {cfg.n_skull} + {cfg.n_implant} points) "
        f"{pcdiff}; voxelizer {models.voxelizer_config.task.preset} {voxelizer}"
    )
    print(f"{len(cases)} test case(s) of {data_root}; seed {args.seed}", flush=True)
    started = time.perf_counter()

    warm_up(cases[0], models, args.seed)
    configs = sweep(cases, models, args)
    print("\nbaseline:", flush=True)
    baseline = run_baseline(data_root, cases)
    threads_cmp = compare_threads(cases, models, args) if args.compare_threads is not None else []
    gpu = gpu_timings(pcdiff, voxelizer, cases, args) if torch.cuda.is_available() and not args.no_gpu else None
    record.update(
        load_average_end=os.getloadavg(),
        seconds=time.perf_counter() - started,
        configs=configs,
        baseline=baseline,
        threads_comparison=threads_cmp,
        gpu=gpu,
    )
    print_results(record, cases, args, cfg)
    path = write_json("pipeline", json_safe(record))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""`pointforge demo`: the whole system on a fresh machine, with no data and no weights.

1. **data** — synthesise a small SkullBreak-style dataset (``skulls`` skulls × 5
   defect classes) and prepare it (surface points, complete masks, a split
   grouped by skull).
2. **train** — PCDiff and the voxelizer side by side, each a ``pointforge train``
   process with one thread, for ``minutes`` of wall-clock time
   (``train.max_minutes``), in phases: after each phase the checkpoints are kept
   so the report can show what more training buys (the learning curve).
3. **generate** — implants for every held-out case (test and validation
   splits) with the checkpoints of each phase
   (:func:`~pointforge.implant.generate.generate_folder`); the phase with the
   best validation DSC is the one the report is about (:func:`chosen_phase`),
   so the test cases never choose.
4. **baseline** — the same cases filled with the mean of the registered training
   skulls (:mod:`pointforge.implant.baseline`).
5. **evaluate** — DSC, bDSC and HD95 of both against the true implants.
6. **report** — ``report.md`` and ``report.html`` with previews, metrics per case
   and per defect class, the curve, timings, and the commands that reproduce each
   step at full scale on GPUs; ``demo.json`` holds every number.

Every number in the report is computed in this run; nothing is cached. The
output folder must be new or empty (a previous demo is never overwritten).

It lives in :mod:`pointforge.implant` because it is the implant pipeline end to
end: it calls the data, generate, baseline and evaluate functions of this
layer and starts training as ``pointforge train`` processes, so it needs
nothing above it (the CLI's ``demo`` command only parses and prints).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from pointforge.atomic import atomic_write_bytes, atomic_write_text
from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.synthetic.dataset import synthesize
from pointforge.data.volumes import read_binary_volume, write_volume
from pointforge.errors import DataError, UserError
from pointforge.formats import json_safe
from pointforge.implant.baseline import Atlas, mean_skull_implant
from pointforge.implant.evaluate import evaluate_predictions, write_reports
from pointforge.implant.folder import generate_folder
from pointforge.implant.pipeline import GenerateOptions, load_models
from pointforge.implant.report_page import CaseCard, relative, write_report_html
from pointforge.implant.view import PLOTLY_JS
from pointforge.implant.writer import generate_case
from pointforge.tasks.pcdiff.placement import placement_metrics

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # package data
PCDIFF_CONFIG = REPO_CONFIGS / "pcdiff" / "demo.yaml"
VOXELIZER_CONFIG = REPO_CONFIGS / "voxelizer" / "demo.yaml"


@dataclass
class DemoSettings:
    minutes: float = 5.0  # training wall-clock budget; the two models train side by side
    skulls: int = 10
    size: int = 64
    points: int = 16_384  # surface points per prepared volume
    split: str = "0.6,0.2,0.2"
    seed: int = 0
    ensemble: int = 5
    sampler: str = "dpm++2m"
    steps: int | None = 20
    phases: tuple[float, ...] = (0.25, 0.5, 1.0)  # fractions of the budget at which the models are evaluated
    device: str = "auto"
    workers: int | None = None
    data: str | None = None  # a raw SkullBreak/SkullFix folder to use instead of synthetic skulls

    def validate(self) -> None:
        if not self.minutes > 0:
            raise UserError(f"--minutes must be positive, got {self.minutes}")
        if self.data is not None and not Path(self.data).is_dir():
            raise UserError(f"--data {self.data}: no such folder; give a raw SkullBreak or SkullFix dataset folder")
        if self.skulls < 5:
            raise UserError(f"--skulls must be at least 5 (training, validation and test skulls), got {self.skulls}")
        if self.size < 48:
            raise UserError(f"--size must be at least 48 (thinner grids lose the bone), got {self.size}")
        if sorted(self.phases) != list(self.phases) or not self.phases or self.phases[-1] != 1.0:
            raise UserError("phases must increase and end at 1.0")


@dataclass
class DemoResult:
    out: Path
    report_md: Path
    report_html: Path
    summary: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- training, as subprocesses


def _decays(config: Path) -> bool:
    """Whether ``config``'s LR schedule decays (cosine or linear): the demo then spreads it over the whole budget."""
    sched = (yaml.safe_load(config.read_text()) or {}).get("sched") or {}
    return sched.get("name") in ("cosine", "linear")


def _train_command(
    task: str, config: Path, run_dir: Path, data_root: Path, minutes: float, device: str, horizon: float | None
) -> list[str]:
    # A decaying schedule runs over the whole budget (all phases), in minutes of
    # training, so that the LR reaches its floor as the last phase ends.
    decay = [f"sched.horizon_minutes={horizon:g}"] if horizon is not None else []
    return [
        sys.executable,
        "-m",
        "pointforge.cli",
        "train",
        task,
        "--config",
        str(config),
        "--resume",
        "auto",
        f"run.dir={run_dir}",
        f"task.data_root={data_root}",
        f"train.max_minutes={minutes:.4f}",
        "train.epochs=100000",
        "train.max_steps=null",
        f"run.device={device}",
        "log.progress=off",
        *decay,
    ]


def _run_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _train_side_by_side(
    jobs: dict[str, list[str]], run_dirs: dict[str, Path], minutes: float, *, progress=None
) -> dict[str, dict]:
    """Start each job, wait for all, show progress; one clear error if any fails."""
    procs = {}
    logs = {}
    for name, cmd in jobs.items():
        run_dirs[name].parent.mkdir(parents=True, exist_ok=True)
        logs[name] = open(run_dirs[name].parent / f"{name}.log", "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs[name] = subprocess.Popen(cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    try:
        while any(p.poll() is None for p in procs.values()):
            if progress:  # the budget counts from each process's first step: keep the bar short of full until they end
                progress(
                    min(time.monotonic() - t0, minutes * 60 * 0.99),
                    minutes * 60,
                    {n: _run_status(run_dirs[n]).get("global_step") for n in procs},
                )
            time.sleep(1.0)
    except BaseException:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        raise
    finally:
        for fh in logs.values():
            fh.close()
    failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if failed:
        name = next(iter(failed))
        tail = (run_dirs[name].parent / f"{name}.log").read_text().strip().splitlines()[-3:]
        raise DataError(
            f"training {name} failed (exit {failed[name]}): {' | '.join(tail)}; "
            f"full log: {run_dirs[name].parent / f'{name}.log'}"
        )
    final = {n: _run_status(run_dirs[n]) for n in procs}
    if progress:
        progress(minutes * 60, minutes * 60, {n: final[n].get("global_step") for n in procs})
    return final


# --------------------------------------------------------------------------- the demo


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not empty; give a new --out (the demo never overwrites results)")


def _fmt(value, digits=3) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _make_data(out: Path, s: DemoSettings, log: Callable[[str], None], progress) -> tuple[Path, Path]:
    """Stage 1: the raw dataset (synthetic, or the user's ``s.data``) and its prepared form under ``out/data``."""
    raw, prepared = out / "data" / "raw", out / "data" / "prepared"
    if s.data is None:
        log(f"[1/6] synthesising {s.skulls} SkullBreak-style skulls at {s.size}³ and preparing them → {out / 'data'}")
        synthesize(raw, s.skulls, s.size, s.seed, layout="skullbreak")
    else:
        raw = Path(s.data)
        log(f"[1/6] preparing {raw} (split {s.split} by skull) → {prepared}")
    prep = prepare_dataset(
        raw,
        prepared,
        n_points=s.points,
        seed=s.seed,
        split=s.split,
        workers=s.workers,
        progress=(lambda d, n, _name: progress("prepare", d, n, None)) if progress else None,
    )
    if prep.failures:
        raise DataError(f"prepare failed on {raw}: " + "; ".join(prep.failures))
    return raw, prepared


def _train_phases(out: Path, s: DemoSettings, prepared: Path, log: Callable[[str], None], progress) -> list[dict]:
    """Stage 2: both models trained side by side in phases; each phase's checkpoints kept (the learning curve)."""
    run_dirs = {"pcdiff": out / "runs" / "pcdiff", "voxelizer": out / "runs" / "voxelizer"}
    configs = {"pcdiff": PCDIFF_CONFIG, "voxelizer": VOXELIZER_CONFIG}
    kept: list[dict] = []
    done_fraction = 0.0
    for k, fraction in enumerate(s.phases):
        minutes = (fraction - done_fraction) * s.minutes
        log(
            f"[2/6] training PCDiff and the voxelizer side by side: phase {k + 1}/{len(s.phases)}, "
            f"{minutes:.2f} min (to {fraction * s.minutes:.2f} of {s.minutes:g} min)"
        )
        jobs = {
            n: _train_command(
                n, configs[n], run_dirs[n], prepared, minutes, s.device, s.minutes if _decays(configs[n]) else None
            )
            for n in run_dirs
        }
        status = _train_side_by_side(
            jobs, run_dirs, minutes, progress=(lambda d, n, info: progress("train", d, n, info)) if progress else None
        )
        snapshot: dict[str, Any] = {"minutes": round(fraction * s.minutes, 3)}
        for name in run_dirs:
            src = Path(status[name].get("last_checkpoint") or run_dirs[name] / "checkpoints" / "latest.pt")
            dst = out / "checkpoints" / f"{name}-{fraction * s.minutes:.2f}min.pt"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            snapshot[name] = {
                "checkpoint": str(dst),
                "step": status[name].get("global_step"),
                "metrics": status[name].get("metrics", {}),
            }
        kept.append(snapshot)
        done_fraction = fraction
    return kept


def _generate_and_evaluate(
    out: Path,
    s: DemoSettings,
    kept: list[dict],
    raw: Path,
    prepared: Path,
    case_ids: dict[str, list[str]],
    log: Callable[[str], None],
    progress,
) -> list[dict]:
    """Stage 3: implants for the held-out cases with each phase's checkpoints, each set evaluated.

    ``case_ids`` by split: the test cases make the curve and the verdict; the
    validation cases (when the split has any) choose the phase whose models
    the verdict is about, so the test cases play no part in that choice.
    """
    curve = []
    for k, snap in enumerate(kept):
        label = "final" if k == len(kept) - 1 else f"{snap['minutes']:.2f}min"
        log(f"[3/6] generating implants with the models after {snap['minutes']:g} min")
        models = load_models(snap["pcdiff"]["checkpoint"], snap["voxelizer"]["checkpoint"], device=s.device)
        scored = {}
        for split, root in (("test", out / "implants" / label), ("val", out / "implants" / "validation" / label)):
            if case_ids.get(split):
                scored[split] = _score_split(
                    s, models, split, root, (raw, prepared, out / PLOTLY_JS), case_ids[split], log, progress, snap
                )
        gen, evaluation = scored["test"]
        val = scored.get("val")
        curve.append(
            {
                "minutes": snap["minutes"],
                "steps": {n: snap[n]["step"] for n in ("pcdiff", "voxelizer")},
                "failed": gen.failed,
                "evaluation": evaluation,
                "root": out / "implants" / label,
                "val_dsc_mean": _mean_dsc(val[1], case_ids["val"]) if val else None,
            }
        )
    return curve


def _score_split(s: DemoSettings, models, split: str, root: Path, paths: tuple, ids, log, progress, snap):
    """Implants for one split's cases into ``root``, evaluated against the true implants: (generated, evaluation).

    ``paths``: the raw dataset, the prepared one and the shared plotly.js.
    """
    raw, prepared, viewer_js = paths
    log(f"      {len(ids)} {'validation' if split == 'val' else 'test'} cases → {root}")
    gen = generate_folder(
        prepared,
        root,
        models,
        GenerateOptions(ensemble=s.ensemble, sampler=s.sampler, steps=s.steps, seed=s.seed),
        split=split,
        log=log,
        progress=(lambda d, n: progress("generate", d, n, snap["minutes"])) if progress else None,
        viewer_js=viewer_js,
    )
    evaluation = evaluate_predictions(root, raw, cases=ids, progress=_scoring(progress))
    write_reports(evaluation, root)
    return gen, evaluation


def chosen_phase(curve: list[dict]) -> int:
    """The phase with the best validation mean DSC (the later one on a tie); the last without validation cases."""
    scored = [(c["val_dsc_mean"], k) for k, c in enumerate(curve) if c.get("val_dsc_mean") is not None]
    return max(scored)[1] if scored else len(curve) - 1


def _run_oracle(dataset: PreparedDataset, out: Path, snapshot: dict, s: DemoSettings, cases, progress=None) -> None:
    """Each test case's true implant points, as ``s.ensemble`` proposals, through the pipeline after PCDiff."""
    options = GenerateOptions(ensemble=s.ensemble, sampler=s.sampler, steps=s.steps, seed=s.seed)
    models = load_models(snapshot["pcdiff"]["checkpoint"], snapshot["voxelizer"]["checkpoint"], device=s.device)
    n_implant = models.pcdiff.config.n_implant
    rng = np.random.default_rng(s.seed)
    for k, case in enumerate(cases):
        if progress and k == 0:
            progress("oracle", 0, len(cases), None)
        meta = dataset.meta(case.implant)
        points = np.asarray(dataset.points(case.implant), dtype=np.float64)
        affine = (
            np.asarray(meta["direction"], dtype=np.float64) * np.asarray(meta["spacing"], dtype=np.float64)[None, :]
        )
        points_mm = points @ affine.T + np.asarray(meta["origin"], dtype=np.float64)
        chosen = np.stack(
            [
                points_mm[rng.choice(len(points_mm), n_implant, replace=len(points_mm) < n_implant)]
                for _ in range(s.ensemble)
            ]
        )
        generate_case(
            dataset.meta(case.defective)["source"],
            out / case.case_id,
            models,
            options,
            proposals_mm=chosen,
            title=f"{case.case_id}: oracle (true implant points)",
            viewer_js=out.parent / PLOTLY_JS,
        )
        if progress:
            progress("oracle", k + 1, len(cases), None)


def placement_rows(dataset: PreparedDataset, root: Path, cases) -> list[dict]:
    """Per case generated under ``root``: the placement of its generated points (mm) against the true
    implant points (:func:`pointforge.tasks.pcdiff.placement.placement_metrics`, the case's proposals averaged)."""
    rows = []
    for case in cases:
        path = root / case.case_id / "proposals" / "points.npy"
        if not path.is_file():
            continue
        spacing = np.asarray(dataset.meta(case.defective)["spacing"], dtype=np.float64)
        pred = torch.from_numpy(np.load(path).astype(np.float64) * spacing)
        true = torch.from_numpy(np.asarray(dataset.points(case.implant), dtype=np.float64) * spacing)
        found = placement_metrics(pred, true[None].expand(len(pred), -1, -1))
        rows.append({"case": case.case_id, **{name: float(values.mean()) for name, values in found.items()}})
    return rows


def placement_summary(dataset: PreparedDataset, root: Path, cases) -> dict[str, float]:
    """The means of :func:`placement_rows` over the cases."""
    rows = placement_rows(dataset, root, cases)
    return {name: float(np.mean([r[name] for r in rows])) for name in (rows[0] if rows else {}) if name != "case"}


def _summary(
    s: DemoSettings,
    case_ids: list[str],
    curve: list[dict],
    baseline_eval,
    base_stats: dict,
    kept: list[dict],
    timings: dict[str, float],
    placements: list[dict],
    oracle_eval,
) -> dict:
    summary = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "cases": case_ids,
        "pipeline": curve[chosen_phase(curve)]["evaluation"].summary,
        "baseline": baseline_eval.summary,
        "curve": [
            {
                "minutes": c["minutes"],
                "steps": c["steps"],
                "failed": c["failed"],
                "dsc_mean": _mean_dsc(c["evaluation"], case_ids),
                "val_dsc_mean": c.get("val_dsc_mean"),
                "placement": p,
            }
            for c, p in zip(curve, placements)
        ],
        "oracle": oracle_eval.summary,
        "oracle_dsc_mean": _mean_dsc(oracle_eval, case_ids),
        "baseline_dsc_mean": _mean_dsc(baseline_eval, case_ids),
        "baseline_info": base_stats,
        "phases": kept,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    summary["chosen"] = chosen_phase(curve)
    pipe = summary["curve"][summary["chosen"]]["dsc_mean"]
    base = summary["baseline_dsc_mean"]
    summary["beats_baseline"] = bool(pipe is not None and base is not None and pipe > base)
    return summary


def run_demo(
    out: str | os.PathLike = "demo_out",
    settings: DemoSettings | None = None,
    *,
    log: Callable[[str], None] = print,
    progress=None,
) -> DemoResult:
    """Run every stage into ``out``. ``progress(stage, done, total, info)`` reports long stages."""
    s = settings or DemoSettings()
    s.validate()
    for config in (PCDIFF_CONFIG, VOXELIZER_CONFIG):
        if not config.is_file():
            raise UserError(
                f"{config}: the demo's training config is missing; reinstall pointforge from its repository"
            )
    out = Path(out)
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = t = time.perf_counter()
    raw, prepared = _make_data(out, s, log, progress)
    timings["data_s"] = time.perf_counter() - t
    dataset = PreparedDataset(prepared)
    test_cases = dataset.split("test")
    case_ids = [c.case_id for c in test_cases]
    val_ids = [c.case_id for c in dataset.split("val")]

    t = time.perf_counter()
    kept = _train_phases(out, s, prepared, log, progress)
    timings["train_s"] = time.perf_counter() - t

    t = time.perf_counter()
    curve = _generate_and_evaluate(out, s, kept, raw, prepared, {"test": case_ids, "val": val_ids}, log, progress)
    placements = [placement_summary(dataset, c["root"], test_cases) for c in curve]
    chosen = chosen_phase(curve)
    timings["generate_evaluate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    log(
        "[4/6] oracle: the true implant points through the same voxelizer and clean-up (what a perfect PCDiff would reach)"
    )
    _run_oracle(dataset, out / "oracle", kept[chosen], s, test_cases, progress)
    oracle_eval = evaluate_predictions(out / "oracle", raw, cases=case_ids, progress=_scoring(progress))
    write_reports(oracle_eval, out / "oracle")
    timings["oracle_s"] = time.perf_counter() - t

    t = time.perf_counter()
    log(
        f"[5/6] baseline: the defect filled with the mean of the {len({c.skull_id for c in dataset.split('train')})} registered training skulls"
    )
    base_root = out / "baseline"
    base_stats = _run_baseline(prepared, base_root, progress)
    baseline_eval = evaluate_predictions(base_root, raw, cases=case_ids, progress=_scoring(progress))
    write_reports(baseline_eval, base_root)
    timings["baseline_s"] = time.perf_counter() - t

    summary = _summary(s, case_ids, curve, baseline_eval, base_stats, kept, timings, placements, oracle_eval)

    log("[6/6] writing the report")
    t = time.perf_counter()
    timings["report_s"] = 0.0
    summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
    md, page = _write_report(out, summary, curve, baseline_eval, base_root)
    summary["timings_s"]["report_s"] = round(time.perf_counter() - t, 1)
    atomic_write_text(out / "demo.json", json.dumps(json_safe(summary), indent=1))
    return DemoResult(out=out, report_md=md, report_html=page, summary=summary)


def _mean_dsc(evaluation, case_ids: list[str]) -> float:
    """Mean DSC over all ``case_ids``; a case without a usable implant (failed, missing, empty) counts as 0."""
    scores = {r["case_id"]: r.get("dsc") for r in evaluation.rows}
    values = [scores.get(c) for c in case_ids]
    return float(sum(v if v is not None and math.isfinite(v) else 0.0 for v in values) / max(len(values), 1))


def _scoring(progress):
    return (lambda d, n: progress("score", d, n, None)) if progress else None


def _run_baseline(prepared: Path, out: Path, progress=None) -> dict:
    """Mean-of-registered-training-skulls implants for the test split into ``out/<case_id>/implant.nrrd``."""
    data = PreparedDataset(prepared)
    atlas = Atlas.from_prepared(data, split="train")
    seconds = []
    cases = data.split("test")
    for k, case in enumerate(cases):
        if progress and k == 0:
            progress("baseline", 0, len(cases), None)
        t = time.perf_counter()
        defective = read_binary_volume(data.meta(case.defective)["source"])
        implant = mean_skull_implant(defective, atlas)
        write_volume(out / case.case_id / "implant.nrrd", implant)
        seconds.append(time.perf_counter() - t)
        if progress:
            progress("baseline", k + 1, len(cases), None)
    return {"atlas_skulls": len(atlas), "seconds_per_case": round(sum(seconds) / max(len(seconds), 1), 2)}


# --------------------------------------------------------------------------- report


def _reproduce_commands() -> list[tuple[str, str]]:
    return [
        ("prepare SkullBreak", "pointforge data prepare /data/SkullBreak --out data/skullbreak"),
        (
            "train PCDiff on 8 GPUs",
            "pointforge train pcdiff --config paper --nproc 8 task.data_root=data/skullbreak",
        ),
        (
            "train the voxelizer on 8 GPUs",
            "pointforge train voxelizer --config paper --nproc 8 task.data_root=data/skullbreak",
        ),
        (
            "generate the test split's implants",
            "pointforge generate data/skullbreak --pcdiff runs/pcdiff/paper/checkpoints/best.pt "
            "--voxelizer runs/voxelizer/paper/checkpoints/best.pt --out implants --ensemble 5",
        ),
        ("evaluate", "pointforge evaluate implants --truth /data/SkullBreak"),
    ]


def _curve_plot(path: Path, summary: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    xs = [c["minutes"] for c in summary["curve"]]
    ys = [c["dsc_mean"] if c["dsc_mean"] is not None else float("nan") for c in summary["curve"]]
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    ax.plot(xs, ys, "o-", color="tab:orange", label="PCDiff + voxelizer")
    val = [c.get("val_dsc_mean") for c in summary["curve"]]
    if any(v is not None for v in val):
        ax.plot(xs, [float("nan") if v is None else v for v in val], "s:", color="tab:gray", label="same, validation")
    k = summary.get("chosen", len(xs) - 1)
    ax.plot([xs[k]], [ys[k]], "o", ms=12, mfc="none", mec="black", label="chosen (validation)")
    if summary["baseline_dsc_mean"] is not None:
        ax.axhline(summary["baseline_dsc_mean"], color="tab:blue", ls="--", label="mean registered skull")
    ax.set_xlabel("training minutes (both models, side by side)")
    ax.set_ylabel("mean DSC, held-out cases")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _metric_cell(stats: dict | None, metric: str) -> str:
    if not stats or metric not in stats or not stats[metric].get("n"):
        return "–"
    m = stats[metric]
    digits = 2 if metric.startswith("hd") else 3
    return f"{m['mean']:.{digits}f} ± {m['std']:.{digits}f} (median {m['median']:.{digits}f})"


Table = tuple[list[str], list[list[str]]]


def _tables(summary: dict, curve: list[dict], baseline_eval) -> dict[str, Table]:
    """Every table of the report, by name."""
    return {
        "by_class": _by_class_table(summary),
        "curve": _curve_table(summary, curve),
        "cases": _cases_table(curve[summary["chosen"]], baseline_eval),
        "stages": _stages_table(curve[summary["chosen"]]),
        "demo_times": (
            ["demo stage", "seconds"],
            [[k.removesuffix("_s"), f"{v:.1f}"] for k, v in summary["timings_s"].items()],
        ),
        "limits": _limits_table(summary),
    }


def _by_class_table(summary: dict) -> Table:
    pipe, base = summary["pipeline"], summary["baseline"]
    groups = [g for g in pipe if g != "all"] + ["all"]
    headers = ["defect class", "n", "PCDiff DSC", "baseline DSC", "PCDiff bDSC", "baseline bDSC"]
    headers += ["PCDiff HD95 (mm)", "baseline HD95 (mm)"]
    rows = [
        [g, str(pipe[g]["dsc"]["n"])]
        + [_metric_cell(stats, m) for m in ("dsc", "bdsc", "hd95") for stats in (pipe[g], base.get(g))]
        for g in groups
    ]
    return headers, rows


def _curve_table(summary: dict, curve: list[dict]) -> Table:
    headers = ["training min", "PCDiff steps", "voxelizer steps", "mean DSC (failed = 0)", "centroid error (mm)"]
    headers += ["spread ratio", "mean bDSC", "mean HD95 (mm)", "failed cases", "validation mean DSC"]
    rows = []
    for k, (c, p) in enumerate(zip(curve, (k["placement"] for k in summary["curve"]))):
        everything = c["evaluation"].summary.get("all", {})
        rows.append(
            [
                f"{c['minutes']:g}" + (" (chosen)" if k == summary["chosen"] else ""),
                str(c["steps"].get("pcdiff")),
                str(c["steps"].get("voxelizer")),
                _fmt(_mean_dsc(c["evaluation"], summary["cases"])),
                _fmt(p.get("centroid_error"), 1),
                _fmt(p.get("spread_ratio"), 2),
                _fmt(everything.get("bdsc", {}).get("mean")),
                _fmt(everything.get("hd95", {}).get("mean"), 2),
                str(len(c["failed"])),
                _fmt(summary["curve"][k].get("val_dsc_mean")),
            ]
        )
    return headers, rows


def _cases_table(final: dict, baseline_eval) -> Table:
    headers = ["case", "PCDiff DSC", "baseline DSC", "PCDiff bDSC", "PCDiff HD95 (mm)", "implant cm³"]
    headers += ["mean agreement", "STL watertight"]
    base_rows = {r["case_id"]: r for r in baseline_eval.rows}
    rows = []
    for row in final["evaluation"].rows:
        report = _case_report(final["root"] / row["case_id"])
        rows.append(
            [
                row["case_id"],
                _fmt(row.get("dsc")),
                _fmt(base_rows.get(row["case_id"], {}).get("dsc")),
                _fmt(row.get("bdsc")),
                _fmt(row.get("hd95"), 2),
                _fmt((report.get("implant") or {}).get("volume_cm3"), 2),
                _fmt((report.get("agreement") or {}).get("mean_in_implant"), 2),
                "yes" if (report.get("mesh") or {}).get("watertight") else "no",
            ]
        )
    rows += [[case_id, "failed: " + message, "", "", "", "", "", ""] for case_id, message in final["failed"].items()]
    return headers, rows


def _stages_table(final: dict) -> Table:
    stage_sums: dict[str, list[float]] = {}
    for row in final["evaluation"].rows:
        for k, v in (_case_report(final["root"] / row["case_id"]).get("timings_s") or {}).items():
            stage_sums.setdefault(k, []).append(v)
    return (
        ["generation stage", "mean s per case"],
        [[k.removesuffix("_s"), f"{sum(v) / len(v):.2f}"] for k, v in stage_sums.items()],
    )


def _limits_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """PCDiff's points, the true points (oracle) and the baseline through the same scoring: which stage limits."""
    place = summary["curve"][summary["chosen"]]["placement"]
    pipe, base, oracle = summary["pipeline"], summary["baseline"], summary["oracle"]
    return (
        [
            "implant points from",
            "mean DSC",
            "mean bDSC",
            "mean HD95 (mm)",
            "centroid error (mm)",
            "spread ratio",
            "generated → true (mm)",
            "true → generated (mm)",
        ],
        [
            [
                "PCDiff (chosen models)",
                _fmt(summary["curve"][summary["chosen"]]["dsc_mean"]),
                _cell(pipe, "bdsc"),
                _cell(pipe, "hd95", 2),
                _fmt(place.get("centroid_error"), 1),
                _fmt(place.get("spread_ratio"), 2),
                _fmt(place.get("pred_to_true"), 1),
                _fmt(place.get("true_to_pred"), 1),
            ],
            [
                "the true implant (oracle)",
                _fmt(summary["oracle_dsc_mean"]),
                _cell(oracle, "bdsc"),
                _cell(oracle, "hd95", 2),
                "0",
                "1",
                "0",
                "0",
            ],
            [
                "baseline (mean registered skull)",
                _fmt(summary["baseline_dsc_mean"]),
                _cell(base, "bdsc"),
                _cell(base, "hd95", 2),
                "",
                "",
                "",
                "",
            ],
        ],
    )


def _cell(stats: dict, metric: str, digits: int = 3) -> str:
    return _fmt(((stats or {}).get("all") or {}).get(metric, {}).get("mean"), digits)


def _case_report(folder: Path) -> dict:
    try:
        return json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return {}


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _write_report(out: Path, summary: dict, curve: list[dict], baseline_eval, base_root: Path) -> tuple[Path, Path]:
    tables = _tables(summary, curve, baseline_eval)
    _curve_plot(out / "curve.png", summary)
    previews = _previews(curve[summary["chosen"]], out)
    intro, verdict = _intro_and_verdict(summary)
    sections = _sections(verdict)
    commands = _reproduce_commands()
    md_path = _write_markdown(out, intro, sections, tables, previews, commands)
    cards = _cards(summary, curve[summary["chosen"]], baseline_eval, out)
    html_path = write_report_html(out / "report.html", intro, sections, tables, cards, commands)
    return md_path, html_path


def _cards(summary: dict, final: dict, baseline_eval, out: Path) -> list[CaseCard]:
    """One gallery card per held-out case: its preview, scores and 3-D view (chosen models)."""
    scores = {r["case_id"]: r.get("dsc") for r in final["evaluation"].rows}
    base = {r["case_id"]: r.get("dsc") for r in baseline_eval.rows}
    cards = []
    for case_id in summary["cases"]:
        folder = final["root"] / case_id
        said = f"DSC {_fmt(scores.get(case_id))} (baseline {_fmt(base.get(case_id))})"
        if case_id in final["failed"]:
            said = f"failed: {final['failed'][case_id]}"
        cards.append(
            CaseCard(case_id, said, relative(folder / "preview.png", out), relative(folder / "view.html", out))
        )
    return cards


def _previews(final: dict, out: Path) -> list[tuple[str, str]]:
    """One preview per defect class (the first case of each), as (caption, path relative to ``out``)."""
    previews: list[tuple[str, str]] = []
    seen = set()
    for row in final["evaluation"].rows:
        if row["defect"] in seen:
            continue
        path = final["root"] / row["case_id"] / "preview.png"
        if path.is_file():
            seen.add(row["defect"])
            previews.append((f"{row['case_id']} (DSC {_fmt(row.get('dsc'))})", os.path.relpath(path, out)))
    return previews


def _intro_and_verdict(summary: dict) -> tuple[str, str]:
    s = summary["settings"]
    chosen = summary["curve"][summary["chosen"]]
    pipe, base = chosen["dsc_mean"], summary["baseline_dsc_mean"]
    how = (
        f"by their validation mean DSC, {_fmt(chosen['val_dsc_mean'])}"
        if chosen.get("val_dsc_mean") is not None
        else "the last (no validation cases to choose by)"
    )
    verdict = (
        f"PCDiff + voxelizer (the models after {chosen['minutes']:g} min, chosen {how}) "
        f"reach a mean DSC of {_fmt(pipe)} on {len(summary['cases'])} held-out test cases "
        "(a case without an implant counts as 0) "
        f"against {_fmt(base)} for the mean-registered-skull baseline: "
        + (
            "the diffusion pipeline beats the baseline."
            if summary["beats_baseline"]
            else "the diffusion pipeline does NOT beat the baseline at this training budget."
        )
    )
    data = (
        f"Synthetic SkullBreak-style data: {s['skulls']} skulls at {s['size']}³ "
        f"({230 / s['size']:.2f} mm voxels), 5 defect classes each"
        if s.get("data") is None
        else f"Data: {s['data']}"
    )
    intro = (
        f"{data}, split {s['split']} by skull. "
        f"Training: {s['minutes']:g} min of wall-clock time, PCDiff and the voxelizer side by side. "
        f"Generation: ensemble of {s['ensemble']}, sampler {s['sampler']}"
        + (f" {s['steps']} steps" if s["steps"] else "")
        + ". Every number below was computed in this run."
    )
    return intro, verdict


def _sections(verdict: str) -> list[tuple[str, str | None, str | None]]:
    """The report's sections: (title, table name or None, text or None)."""
    return [
        ("Result", None, verdict),
        (
            "Which stage limits the result",
            "limits",
            "The same voxelizer and clean-up fed PCDiff's points, then the true implant points (the oracle): "
            "the gap between the first two rows is PCDiff's, between the oracle and 1 the voxelizer's and the clean-up's. "
            "Placement: distance between the generated and true implant centroids, and the generated points' spread "
            "(RMS radius) over the true one's.",
        ),
        ("Per defect class (chosen models)", "by_class", None),
        (
            "Learning curve",
            "curve",
            "More training, same held-out test cases (baseline: dashed). The models the report is about are the "
            "phase with the best mean DSC on the validation cases (a separate split), so the test cases do not choose.",
        ),
        ("Per case (chosen models)", "cases", None),
        ("Where the time goes", "stages", None),
        ("Demo stages", "demo_times", None),
    ]


def _write_markdown(out: Path, intro: str, sections, tables, previews, commands) -> Path:
    md = ["# pointforge demo report", "", intro, ""]
    for title, key, text in sections:
        md += [f"## {title}", ""]
        if text:
            md += [text, ""]
        if key:
            md += [_md_table(*tables[key]), ""]
        if key == "curve":
            md += ["![learning curve](curve.png)", ""]
    md += ["## Previews (chosen models)", ""]
    md += [f"**{caption}**\n\n![{caption}]({rel})\n" for caption, rel in previews]
    md += ["Every case's turnable 3-D view (`view.html` in its folder) is linked from report.html.", ""]
    md += ["## Reproduce at full scale on GPUs", ""]
    md += [f"{what}:\n\n```\n{cmd}\n```\n" for what, cmd in commands]
    md_path = out / "report.md"
    atomic_write_text(md_path, "\n".join(md) + "\n")

    return md_path

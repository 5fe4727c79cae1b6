"""The demo report's tables, each as ``(headers, rows)`` of strings, built from the run's summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

Table = tuple[list[str], list[list[str]]]


def format_score(value, digits=3) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def tables(summary: dict, test: dict, baseline_eval) -> dict[str, Table]:
    """Every table of the report, by name. ``test``: the chosen phase on the test cases (root, failed, evaluation)."""
    return {
        "intervals": intervals_table(summary),
        "limits": limits_table(summary),
        "by_class": by_class_table(summary),
        "curve": curve_table(summary),
        "cases": cases_table(test, baseline_eval),
        "stages": stages_table(test),
        "time_split": time_split_table(summary),
        "demo_times": (
            ["demo stage", "seconds"],
            [[k.removesuffix("_s"), f"{v:.1f}"] for k, v in summary["timings_s"].items()],
        ),
        **({"student": student_table(summary)} if "student" in summary else {}),
    }


def _interval_cell(stats: dict, digits: int, signed: bool = False) -> str:
    if not stats.get("n"):
        return "–"
    sign = "+" if signed else ""
    return f"{stats['mean']:{sign}.{digits}f} [{stats['low']:{sign}.{digits}f}, {stats['high']:{sign}.{digits}f}]"


def intervals_table(summary: dict) -> Table:
    """Means with their 95 % bootstrap intervals, the paired difference and the verdict, per metric."""
    found = summary["intervals"]
    headers = [
        "test cases",
        *(f"{e['label']}" + (" (mm, lower is better)" if e["lower_is_better"] else "") for e in found.values()),
    ]
    names = {
        "pipeline": "PCDiff pipeline",
        "baseline": "baseline (mean registered skull)",
        "oracle": "oracle (true implant points)",
        "prior": "atlas estimate (PCDiff's start)",
    }
    rows = [
        [label, *(_interval_cell(e[name], 2 if e["lower_is_better"] else 3) for e in found.values())]
        for name, label in names.items()
        if all(name in e for e in found.values())
    ]
    rows.append(
        [
            "difference PCDiff − baseline (paired)",
            *(_interval_cell(e["difference"], 2 if e["lower_is_better"] else 3, signed=True) for e in found.values()),
        ]
    )
    rows.append(["PCDiff …", *(f"{e['verdict']} the baseline" for e in found.values())])
    if all("over_prior" in e for e in found.values()):
        digits = [2 if e["lower_is_better"] else 3 for e in found.values()]
        rows.append(
            [
                "difference PCDiff − its atlas start (paired)",
                *(_interval_cell(e["over_prior"], d, signed=True) for e, d in zip(found.values(), digits)),
            ]
        )
        rows.append(["PCDiff …", *(f"{e['over_prior']['verdict']} its atlas start" for e in found.values())])
    rows.append(["cases", *(str(e["cases"]) for e in found.values())])
    return headers, rows


def _metric_cell(stats: dict | None, metric: str) -> str:
    if not stats or metric not in stats or not stats[metric].get("n"):
        return "–"
    m = stats[metric]
    digits = 2 if metric.startswith("hd") else 3
    return f"{m['mean']:.{digits}f} ± {m['std']:.{digits}f} (median {m['median']:.{digits}f})"


def by_class_table(summary: dict) -> Table:
    pipe, base = summary["pipeline"], summary["baseline"]
    groups = [g for g in pipe if g != "all"] + ["all"]
    headers = ["defect class", "n", "PCDiff DSC", "baseline DSC", "PCDiff bDSC", "baseline bDSC"]
    headers += ["PCDiff HD95 (mm)", "baseline HD95 (mm)"]
    rows = [
        [g, str(pipe[g]["dsc"]["n"])]
        + [_metric_cell(stats, m) for m in ("dsc", "bdsc", "hd95") for stats in (pipe[g], base.get(g))]
        for g in groups
        if g in pipe
    ]
    return headers, rows


def curve_table(summary: dict) -> Table:
    """Per phase: its steps, the probe on the validation cases, and the test cases' DSC for the chosen phase."""
    headers = ["training min", "PCDiff steps", "voxelizer steps", "validation DSC (probe)", "centroid error (mm)"]
    headers += ["spread ratio", "failed (validation)", "test DSC"]
    rows = []
    for k, c in enumerate(summary["curve"]):
        p = c.get("placement") or {}
        chosen = k == summary["chosen"]
        rows.append(
            [
                f"{c['minutes']:g}" + (" (chosen)" if chosen else ""),
                str(c["steps"].get("pcdiff")),
                str(c["steps"].get("voxelizer")),
                format_score(c.get("val_dsc_mean")),
                format_score(p.get("centroid_error"), 1),
                format_score(p.get("spread_ratio"), 2),
                str(len(c.get("val_failed") or {})),
                format_score(summary["pipeline_dsc_mean"]) if chosen else "",
            ]
        )
    return headers, rows


def cases_table(test: dict, baseline_eval) -> Table:
    headers = ["case", "PCDiff DSC", "baseline DSC", "PCDiff bDSC", "PCDiff HD95 (mm)", "implant cm³"]
    headers += ["mean agreement", "STL watertight"]
    base_rows = {r["case_id"]: r for r in baseline_eval.rows}
    rows = []
    for row in test["evaluation"].rows:
        report = case_report(test["root"] / row["case_id"])
        rows.append(
            [
                row["case_id"],
                format_score(row.get("dsc")),
                format_score(base_rows.get(row["case_id"], {}).get("dsc")),
                format_score(row.get("bdsc")),
                format_score(row.get("hd95"), 2),
                format_score((report.get("implant") or {}).get("volume_cm3"), 2),
                format_score((report.get("agreement") or {}).get("mean_in_implant"), 2),
                "yes" if (report.get("mesh") or {}).get("watertight") else "no",
            ]
        )
    rows += [[case_id, "failed: " + message, "", "", "", "", "", ""] for case_id, message in test["failed"].items()]
    return headers, rows


def stages_table(test: dict) -> Table:
    stage_sums: dict[str, list[float]] = {}
    for row in test["evaluation"].rows:
        for k, v in (case_report(test["root"] / row["case_id"]).get("timings_s") or {}).items():
            stage_sums.setdefault(k, []).append(v)
    return (
        ["generation stage", "mean s per case"],
        [[k.removesuffix("_s"), f"{sum(v) / len(v):.2f}"] for k, v in stage_sums.items()],
    )


def time_split_table(summary: dict) -> Table:
    """The demo's wall time by kind of work: training, generating, scoring and the rest."""
    split = dict(summary.get("time_split_s") or {})
    total = split.pop("total", None) or 0.0
    if not split.get("report"):
        split.pop("report", None)  # the report is written after this table; demo.json has its seconds
    rows = [
        [kind, f"{seconds:.1f}", f"{100 * seconds / total:.0f} %" if total else "–"] for kind, seconds in split.items()
    ]
    rows.append(["total", f"{total:.1f}", "100 %"])
    return ["work", "seconds", "share"], rows


def limits_table(summary: dict) -> Table:
    """PCDiff's points, the true points (oracle) and the baseline through the same scoring: which stage limits."""
    place = summary["test"]["placement"]
    pipe, base, oracle = summary["pipeline"], summary["baseline"], summary["oracle"]
    headers = ["implant points from", "mean DSC", "mean bDSC", "mean HD95 (mm)", "centroid error (mm)"]
    headers += ["spread ratio", "generated → true (mm)", "true → generated (mm)"]
    pcdiff = ["PCDiff (chosen models)", format_score(summary["pipeline_dsc_mean"]), _cell(pipe, "bdsc")]
    pcdiff += [_cell(pipe, "hd95", 2)] + [
        format_score(place.get(k), d)
        for k, d in (("centroid_error", 1), ("spread_ratio", 2), ("pred_to_true", 1), ("true_to_pred", 1))
    ]
    rows = [
        pcdiff,
        ["the true implant (oracle)", format_score(summary["oracle_dsc_mean"]), _cell(oracle, "bdsc")]
        + [_cell(oracle, "hd95", 2), "0", "1", "0", "0"],
        ["baseline (mean registered skull)", format_score(summary["baseline_dsc_mean"]), _cell(base, "bdsc")]
        + [_cell(base, "hd95", 2), "", "", "", ""],
    ]
    if "prior" in summary:
        prior = summary["prior"]
        rows.insert(
            1,
            ["the atlas estimate PCDiff starts from", format_score(summary["prior_dsc_mean"]), _cell(prior, "bdsc")]
            + [_cell(prior, "hd95", 2), "", "", "", ""],
        )
    return headers, rows


DIGITS = {"dsc": 3, "bdsc": 3, "hd95": 2}  # decimals each metric is reported with


def student_table(summary: dict) -> Table:
    """The pipeline and the few-step student on the same test cases, and the paired difference student − pipeline."""
    st, settings = summary["student"], summary["settings"]
    headers = ["test cases", "mean DSC", "mean bDSC", "mean HD95 (mm)", "spread ratio", "agreement mean"]
    headers += ["sampling s per case"]
    sampler = settings["sampler"] + (f" {settings['steps']}" if settings["steps"] else "")
    rows = []
    for label, who, dsc, stats in (
        (f"PCDiff pipeline ({sampler})", "pipeline", summary["pipeline_dsc_mean"], summary["pipeline"]),
        (f"{st['calls']}-call student (ddim {st['calls']})", "student", st["dsc_mean"], st["evaluation"]),
    ):
        rows.append([label, format_score(dsc), _cell(stats, "bdsc"), _cell(stats, "hd95", 2)])
        rows[-1] += [format_score(st[key][who], 2) for key in ("spread_ratio", "agreement_mean", "sample_s_per_case")]
    difference = [_interval_cell(st["intervals"][m]["difference"], d, signed=True) for m, d in DIGITS.items()]
    rows.append(["difference student − pipeline (paired)", *difference, "", "", ""])
    return headers, rows


def _cell(stats: dict, metric: str, digits: int = 3) -> str:
    return format_score(((stats or {}).get("all") or {}).get(metric, {}).get("mean"), digits)


def case_report(folder: Path) -> dict:
    try:
        return json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return {}

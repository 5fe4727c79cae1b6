"""The demo's report: ``report.md``, the tables and the learning curve (``report.html`` by :mod:`.report_page`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from pointforge.atomic import atomic_write_bytes, atomic_write_text
from pointforge.implant.demo.report_page import CaseCard, relative, write_report_html
from pointforge.implant.demo.scoring import mean_dsc


def format_score(value, digits=3) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


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
                format_score(mean_dsc(c["evaluation"], summary["cases"])),
                format_score(p.get("centroid_error"), 1),
                format_score(p.get("spread_ratio"), 2),
                format_score(everything.get("bdsc", {}).get("mean")),
                format_score(everything.get("hd95", {}).get("mean"), 2),
                str(len(c["failed"])),
                format_score(summary["curve"][k].get("val_dsc_mean")),
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
                format_score(row.get("dsc")),
                format_score(base_rows.get(row["case_id"], {}).get("dsc")),
                format_score(row.get("bdsc")),
                format_score(row.get("hd95"), 2),
                format_score((report.get("implant") or {}).get("volume_cm3"), 2),
                format_score((report.get("agreement") or {}).get("mean_in_implant"), 2),
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
                format_score(summary["curve"][summary["chosen"]]["dsc_mean"]),
                _cell(pipe, "bdsc"),
                _cell(pipe, "hd95", 2),
                format_score(place.get("centroid_error"), 1),
                format_score(place.get("spread_ratio"), 2),
                format_score(place.get("pred_to_true"), 1),
                format_score(place.get("true_to_pred"), 1),
            ],
            [
                "the true implant (oracle)",
                format_score(summary["oracle_dsc_mean"]),
                _cell(oracle, "bdsc"),
                _cell(oracle, "hd95", 2),
                "0",
                "1",
                "0",
                "0",
            ],
            [
                "baseline (mean registered skull)",
                format_score(summary["baseline_dsc_mean"]),
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
    return format_score(((stats or {}).get("all") or {}).get(metric, {}).get("mean"), digits)


def _case_report(folder: Path) -> dict:
    try:
        return json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return {}


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out: Path, summary: dict, curve: list[dict], baseline_eval, base_root: Path) -> tuple[Path, Path]:
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
        said = f"DSC {format_score(scores.get(case_id))} (baseline {format_score(base.get(case_id))})"
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
            previews.append((f"{row['case_id']} (DSC {format_score(row.get('dsc'))})", os.path.relpath(path, out)))
    return previews


def _intro_and_verdict(summary: dict) -> tuple[str, str]:
    s = summary["settings"]
    chosen = summary["curve"][summary["chosen"]]
    pipe, base = chosen["dsc_mean"], summary["baseline_dsc_mean"]
    how = (
        f"by their validation mean DSC, {format_score(chosen['val_dsc_mean'])}"
        if chosen.get("val_dsc_mean") is not None
        else "the last (no validation cases to choose by)"
    )
    verdict = (
        f"PCDiff + voxelizer (the models after {chosen['minutes']:g} min, chosen {how}) "
        f"reach a mean DSC of {format_score(pipe)} on {len(summary['cases'])} held-out test cases "
        "(a case without an implant counts as 0) "
        f"against {format_score(base)} for the mean-registered-skull baseline: "
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

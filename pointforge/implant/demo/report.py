"""The demo's report: ``report.md`` and the learning curve (tables by :mod:`.report_tables`, HTML by :mod:`.report_page`)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from pointforge.atomic import atomic_write_bytes, atomic_write_text
from pointforge.implant.demo.report_page import CaseCard, relative, write_report_html
from pointforge.implant.demo.report_tables import format_score, tables
from pointforge.implant.demo.training import phase_name
from pointforge.implant.demo.verdict import verdict_sentences


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
    """Validation DSC (the probe) per phase; the chosen phase's test DSC; the baseline's and the oracle's test DSC."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    xs = [c["minutes"] for c in summary["curve"]]
    val = [c.get("val_dsc_mean") for c in summary["curve"]]
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    if any(v is not None for v in val):
        ax.plot(xs, [float("nan") if v is None else v for v in val], "s:", color="tab:gray", label="validation (probe)")
    k = summary.get("chosen", len(xs) - 1)
    ax.plot([xs[k]], [summary["pipeline_dsc_mean"]], "o", ms=9, color="tab:orange", label="test, chosen models")
    ax.axhline(summary["baseline_dsc_mean"], color="tab:blue", ls="--", label="baseline, test")
    ax.axhline(summary["oracle_dsc_mean"], color="tab:green", ls=":", label="oracle, test")
    ax.set_xlabel("training minutes (both models, side by side)")
    ax.set_ylabel("mean DSC")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out: Path, summary: dict, test: dict, baseline_eval) -> tuple[Path, Path]:
    """``report.md``, ``report.html`` and ``curve.png`` into ``out``; ``test``: the chosen phase on the test cases."""
    found = tables(summary, test, baseline_eval)
    _curve_plot(out / "curve.png", summary)
    previews = _previews(test, out)
    intro, verdict = _intro_and_verdict(summary)
    sections = _sections(verdict, student_sentence(summary["student"]) if "student" in summary else None)
    commands = _reproduce_commands()
    md_path = _write_markdown(out, intro, sections, found, previews, _worst_md(summary, test, out), commands)
    cards = _cards(summary, test, baseline_eval, out)
    by_id = {card.case_id: card for card in cards}
    worst = [(by_id[w["case_id"]], w["why"]) for w in summary.get("worst", []) if w["case_id"] in by_id]
    html_path = write_report_html(out / "report.html", intro, sections, found, cards, commands, worst=worst)
    return md_path, html_path


def _cards(summary: dict, test: dict, baseline_eval, out: Path) -> list[CaseCard]:
    """One gallery card per test case: its preview, scores and 3-D view (chosen models)."""
    scores = {r["case_id"]: r.get("dsc") for r in test["evaluation"].rows}
    base = {r["case_id"]: r.get("dsc") for r in baseline_eval.rows}
    cards = []
    for case_id in summary["cases"]:
        folder = test["root"] / case_id
        said = f"DSC {format_score(scores.get(case_id))} (baseline {format_score(base.get(case_id))})"
        if case_id in test["failed"]:
            said = f"failed: {test['failed'][case_id]}"
        cards.append(
            CaseCard(case_id, said, relative(folder / "preview.png", out), relative(folder / "view.html", out))
        )
    return cards


def _previews(test: dict, out: Path) -> list[tuple[str, str]]:
    """One preview per defect class (the first case of each), as (caption, path relative to ``out``)."""
    previews: list[tuple[str, str]] = []
    seen = set()
    for row in test["evaluation"].rows:
        if row["defect"] in seen:
            continue
        path = test["root"] / row["case_id"] / "preview.png"
        if path.is_file():
            seen.add(row["defect"])
            previews.append((f"{row['case_id']} (DSC {format_score(row.get('dsc'))})", os.path.relpath(path, out)))
    return previews


def _intro_and_verdict(summary: dict) -> tuple[str, str]:
    s = summary["settings"]
    chosen = summary["curve"][summary["chosen"]]
    how = (
        f"by their validation DSC in the probe, {format_score(chosen['val_dsc_mean'])}"
        if chosen.get("val_dsc_mean") is not None
        else "the last (no validation cases to choose by)"
    )
    by_steps = bool(summary["settings"].get("train_steps"))
    n_cases = len(summary["cases"])
    n_skulls = len({c.split("/")[-1] for c in summary["cases"]})
    verdict = (
        f"PCDiff + voxelizer (the models after {phase_name(chosen['minutes'], chosen['steps'], by_steps)}, chosen {how}) "
        f"reach a mean DSC of {format_score(summary['pipeline_dsc_mean'])} on {n_cases} test cases from "
        f"{n_skulls} skulls (a case without an implant counts as 0) against "
        f"{format_score(summary['baseline_dsc_mean'])} for the mean-registered-skull baseline and "
        f"{format_score(summary['oracle_dsc_mean'])} for the oracle. "
        + " ".join(f"{sentence}." for sentence in verdict_sentences(summary["intervals"]))
    )
    data = (
        f"Synthetic SkullBreak-style data, {s['family']} family: {s['skulls']} skulls at {s['size']}³ "
        f"({230 / s['size']:.2f} mm voxels), 5 defect classes each"
        if s.get("data") is None
        else f"Data: {s['data']}"
    )
    probe = f"{s['probe_ensemble']} proposals, {s['probe_steps']} steps"
    intro = (
        f"{data}, split {s['split']} by skull. "
        f"Training: {_budget(s)}, PCDiff and the voxelizer side by side (preset {s.get('config', 'demo')}), "
        f"the models kept after each of {len(summary['curve'])} phases and probed on the validation cases ({probe}). "
        f"Test cases: the chosen phase, ensemble of {s['ensemble']}, sampler {s['sampler']}"
        + (f" {s['steps']} steps" if s["steps"] else "")
        + (f", reach {s['reach_mm']:g} mm" if s.get("reach_mm") else "")
        + (f", {s['skull_points']:,} skull points in the voxelizer" if s.get("skull_points") else "")
        + ". Intervals: 95 % bootstrap over the cases (2,000 resamples, seeded). Every number below was computed in this run."
    )
    return intro, verdict


def _budget(s: dict) -> str:
    """The training budget as the run was given it: steps (``--train-steps``) or wall-clock minutes."""
    if s.get("train_steps"):
        pcdiff, voxelizer = s["train_steps"]
        return f"{pcdiff:,} PCDiff and {voxelizer:,} voxelizer steps"
    return f"{s['minutes']:g} min of wall-clock time"


def student_sentence(student: dict) -> str:
    """What distilling the chosen PCDiff into the few-step student cost, and what it changed (the paired intervals)."""
    changed = []
    for entry in student["intervals"].values():
        d, digits = entry["difference"], 2 if entry["lower_is_better"] else 3
        if not entry["cases"]:
            changed.append(f"{entry['label']} not comparable (no case where both made an implant)")
            continue
        changed.append(
            f"{entry['label']} {d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"
            + (" mm" if entry["lower_is_better"] else "")
        )
    sampling = student["sample_s_per_case"]
    fast = (
        f"; sampling a case took {format_score(sampling['student'], 2)} s instead of {format_score(sampling['pipeline'], 2)} s"
        if sampling["student"] is not None and sampling["pipeline"] is not None
        else ""
    )
    return (
        f"Distilling the chosen PCDiff into a {student['calls']}-call student cost {student['training_minutes']:.1f} "
        f"minutes of training ({student['steps']} steps, one process){fast}. On the same test cases it changed "
        "(student − pipeline, paired, 95 % interval): " + ", ".join(changed) + "."
    )


def _sections(verdict: str, student: str | None = None) -> list[tuple[str, str | None, str | None]]:
    """The report's sections: (title, table name or None, text or None); ``student``: the few-step
    student's sentence, whose section follows the limits when the run distilled one."""
    return [
        ("Result", None, verdict),
        (
            "Means and how far to trust them",
            "intervals",
            "Each mean with its 95 % bootstrap interval over the test cases; the difference is taken case by case "
            '(PCDiff − baseline on the same case) and resampled in pairs. "beats" is said only where the '
            "difference's interval excludes 0 on the better side. A case without an implant counts as DSC and "
            "bDSC 0; HD95 uses the cases where every method made an implant.",
        ),
        (
            "Which stage limits the result",
            "limits",
            "The same voxelizer and clean-up fed PCDiff's points, then the true implant points (the oracle): "
            "the gap between the first two rows is PCDiff's, between the oracle and 1 the voxelizer's and the clean-up's. "
            "Placement: distance between the generated and true implant centroids, and the generated points' spread "
            "(RMS radius) over the true one's.",
        ),
        *([("A few-step student", "student", student)] if student else []),
        ("Per defect class (chosen models)", "by_class", None),
        (
            "Learning curve",
            "curve",
            "Each phase's models probed on the validation cases (a separate split, cheaply: few proposals and "
            "sampler steps, nothing written); the best phase there is the one the test cases are generated with, "
            "so the test cases do not choose.",
        ),
        ("Per case (chosen models)", "cases", None),
        ("Where the time goes per case", "stages", None),
        ("Where the demo's time went", "time_split", None),
        ("Demo stages", "demo_times", None),
    ]


def _worst_md(summary: dict, test: dict, out: Path) -> list[str]:
    """The report.md section on the worst cases: each with why it fails and its preview."""
    if not summary.get("worst"):
        return []
    md = ["## The worst test cases, and why", ""]
    md += ["The lowest DSC first; report.html shows each in 3-D.", ""]
    for w in summary["worst"]:
        md += [f"**{w['case_id']}** (DSC {format_score(w['dsc'])}): {w['why']}.", ""]
        preview = test["root"] / w["case_id"] / "preview.png"
        if preview.is_file():
            md += [f"![{w['case_id']}]({os.path.relpath(preview, out)})", ""]
    return md


def _write_markdown(out: Path, intro: str, sections, found, previews, worst: list[str], commands) -> Path:
    md = ["# pointforge demo report", "", intro, ""]
    for title, key, text in sections:
        md += [f"## {title}", ""]
        if text:
            md += [text, ""]
        if key:
            md += [_md_table(*found[key]), ""]
        if key == "curve":
            md += ["![learning curve](curve.png)", ""]
    md += ["## Previews (chosen models)", ""]
    md += [f"**{caption}**\n\n![{caption}]({rel})\n" for caption, rel in previews]
    md += ["Every case's turnable 3-D view (`view.html` in its folder) is linked from report.html.", ""]
    md += worst
    md += ["## Reproduce at full scale on GPUs", ""]
    md += [f"{what}:\n\n```\n{cmd}\n```\n" for what, cmd in commands]
    md_path = out / "report.md"
    atomic_write_text(md_path, "\n".join(md) + "\n")
    return md_path

"""The demo's verdict: each mean with its 95 % bootstrap interval, and "beats" only where the paired interval says so.

The pipeline, the baseline and the oracle are scored on the same test cases.
Per metric (DSC, bDSC, HD95) each method's mean gets a bootstrap interval
over the cases, and so does the per-case difference pipeline − baseline
(:mod:`pointforge.implant.stats`, seeded with the demo's seed). The report
says the pipeline beats the baseline on a metric only when that difference's
interval excludes zero on the better side (for HD95, lower is better).

What a case without a usable implant counts as: DSC and bDSC 0 (the worst
score; the means in the report count them the same way). HD95 has no value
there, and no fair stand-in, so the HD95 rows use the cases where every
method made an implant, and say how many that is.
"""

from __future__ import annotations

import math

import numpy as np

from pointforge.implant.evaluate import Evaluation
from pointforge.implant.stats import bootstrap_mean, paired_difference, verdict, verdict_words

# (metric, its name in the report, whether lower is better)
METRICS = (("dsc", "DSC", False), ("bdsc", "bDSC", False), ("hd95", "HD95", True))
METHODS = ("pipeline", "baseline", "oracle", "prior")


def _scores(evaluation: Evaluation, case_ids: list[str], metric: str) -> list[float | None]:
    """Per case (in ``case_ids`` order) the metric's finite value, else None."""
    found = {r["case_id"]: r.get(metric) for r in evaluation.rows if r.get("error") is None}
    out: list[float | None] = []
    for case_id in case_ids:
        value = found.get(case_id)
        out.append(float(value) if value is not None and math.isfinite(value) else None)
    return out


def case_values(evaluations: dict[str, Evaluation], case_ids: list[str], metric: str) -> tuple[dict, list[str]]:
    """Each method's per-case values of ``metric`` as arrays over the same cases, and those cases.

    DSC and bDSC: every case, one without a value counting as 0. HD95: the
    cases where every method has a value.
    """
    scores = {name: _scores(ev, case_ids, metric) for name, ev in evaluations.items()}
    if metric != "hd95":
        return {n: np.asarray([0.0 if v is None else v for v in vs]) for n, vs in scores.items()}, list(case_ids)
    keep = [k for k in range(len(case_ids)) if all(vs[k] is not None for vs in scores.values())]
    return {n: np.asarray([vs[k] for k in keep], dtype=np.float64) for n, vs in scores.items()}, [
        case_ids[k] for k in keep
    ]


def paired_comparison(
    evaluations: dict[str, Evaluation], case_ids: list[str], first: str, second: str, *, seed: int = 0
) -> dict[str, dict]:
    """Per metric: the paired difference ``first`` − ``second`` over the cases both scored, its 95 % bootstrap
    interval and the verdict, with the metric's label, direction and case count."""
    found = {}
    for metric, label, lower_is_better in METRICS:
        values, used = case_values(evaluations, case_ids, metric)
        difference = paired_difference(values[first], values[second], seed=seed)
        found[metric] = {
            "label": label,
            "lower_is_better": lower_is_better,
            "cases": len(used),
            "difference": difference.as_dict(),
            "verdict": verdict(difference, lower_is_better=lower_is_better),
        }
    return found


def intervals(evaluations: dict[str, Evaluation], case_ids: list[str], *, seed: int = 0) -> dict[str, dict]:
    """Per metric: each method's mean and interval, the paired difference pipeline − baseline, the verdict.

    ``evaluations`` holds the ``pipeline`` and ``baseline`` (and optionally
    ``oracle`` and ``prior``) evaluations of the test cases ``case_ids``; with
    ``prior``, ``over_prior`` is the paired difference pipeline − prior.
    """
    found = paired_comparison(evaluations, case_ids, "pipeline", "baseline", seed=seed)
    for metric, _, lower_is_better in METRICS:
        values, _ = case_values(evaluations, case_ids, metric)
        entry = found[metric]
        found[metric] = {
            **{k: entry[k] for k in ("label", "lower_is_better", "cases")},
            **{name: bootstrap_mean(v, seed=seed).as_dict() for name, v in values.items()},
            **{k: entry[k] for k in ("difference", "verdict")},
        }
        if "prior" in values:  # what PCDiff adds to the atlas estimate it starts from
            over = paired_difference(values["pipeline"], values["prior"], seed=seed)
            found[metric]["over_prior"] = {**over.as_dict(), "verdict": verdict(over, lower_is_better=lower_is_better)}
    return found


def verdict_sentences(found: dict[str, dict]) -> list[str]:
    """One sentence per metric, e.g. "PCDiff's pipeline beats the baseline on DSC (difference +0.081, 95 % [+0.032, +0.129], 20 cases)"."""
    sentences = []
    for entry in found.values():
        d = entry["difference"]
        if not entry["cases"]:
            sentences.append(f"{entry['label']}: no case where every method made an implant, nothing to compare")
            continue
        digits = 2 if entry["lower_is_better"] else 3
        said = verdict_words("PCDiff's pipeline", entry["verdict"], "the baseline", entry["label"])
        sentences.append(
            f"{said}: difference {d['mean']:+.{digits}f}, 95 % interval [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}] "
            f"over {entry['cases']} cases" + (" (lower is better)" if entry["lower_is_better"] else "")
        )
    return sentences


def beats(found: dict[str, dict]) -> dict[str, bool]:
    """Per metric, whether the pipeline beats the baseline (the interval of the difference excludes zero)."""
    return {metric: entry["verdict"] == "beats" for metric, entry in found.items()}

"""The demo's worst test cases and why they fail, said from numbers the run computed.

A case's loss (1 − its DSC) is split where the demo can split it: the part the
voxelizer and clean-up lose even when given the true implant points (1 − the
oracle's DSC on that case) and the part PCDiff's points add (the oracle's DSC −
PCDiff's). Beside it: what the atlas estimate PCDiff starts from gave on the
case, and where PCDiff's points lie against the true implant
(:func:`~pointforge.implant.demo.workers.placement_mm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["WORST", "why_it_fails", "worst_cases"]

WORST = 3  # cases the report shows in 3-D
NEAR_START = 0.02  # a DSC change from the atlas start smaller than this is "stayed near it"


def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def why_it_fails(
    dsc: float | None,
    oracle: float | None = None,
    start: float | None = None,
    placement: Mapping[str, float] | None = None,
    failed: str | None = None,
) -> str:
    """One paragraph: where a case's DSC was lost (``oracle``, ``start``: the same case's DSC from the
    true implant points and from the atlas estimate; ``placement``: its points against the true implant)."""
    if failed is not None:
        return f"no implant: {failed} (counted as DSC 0)"
    dsc, oracle, start = _finite(dsc), _finite(oracle), _finite(start)
    if dsc is None:
        return "no score"
    said = []
    if oracle is not None:
        chain, points = 1.0 - oracle, oracle - dsc
        mostly = "mostly the voxelizer and clean-up" if chain >= points else "mostly PCDiff's points"
        said.append(
            f"of its DSC loss {1.0 - dsc:.3f}, {chain:.3f} is lost by the voxelizer and clean-up (the true implant "
            f"points through them reach {oracle:.3f} here) and {points:.3f} by PCDiff's points: {mostly}"
        )
    if start is not None:
        stayed = "; PCDiff stayed near it" if abs(dsc - start) < NEAR_START else ""
        said.append(f"the atlas estimate PCDiff starts from gave {start:.3f} ({dsc - start:+.3f} by PCDiff{stayed})")
    if placement:
        said.append(
            f"its points are centred {placement['centroid_error']:.1f} mm from the true implant's, spread "
            f"{placement['spread_ratio']:.2f} of its spread, lie {placement['pred_to_true']:.1f} mm from it and leave "
            f"it {placement['true_to_pred']:.1f} mm from the nearest point (means)"
        )
    return "; ".join(said) if said else "no oracle, start or placement to compare with"


def worst_cases(
    dsc_by_source: Mapping[str, Mapping[str, float | None]],
    case_ids: Sequence[str],
    placements: Sequence[Mapping] = (),
    failed: Mapping[str, str] | None = None,
    n: int = WORST,
) -> list[dict]:
    """The ``n`` test cases with the lowest PCDiff DSC (a failed one first), each with :func:`why_it_fails`.

    ``dsc_by_source``: case id → DSC for ``pipeline`` and, where scored, ``oracle`` and ``prior``.
    """
    failed = failed or {}
    where = {p["case"]: p for p in placements}
    pipeline, oracle, prior = (dsc_by_source.get(k, {}) for k in ("pipeline", "oracle", "prior"))

    def score(case_id: str) -> float:
        value = None if case_id in failed else _finite(pipeline.get(case_id))
        return -1.0 if value is None else value

    found = []
    for case_id in sorted(case_ids, key=score)[:n]:
        reason = why_it_fails(
            pipeline.get(case_id), oracle.get(case_id), prior.get(case_id), where.get(case_id), failed.get(case_id)
        )
        found.append(
            {
                "case_id": case_id,
                "dsc": None if case_id in failed else _finite(pipeline.get(case_id)),
                "oracle_dsc": _finite(oracle.get(case_id)),
                "prior_dsc": _finite(prior.get(case_id)),
                "why": reason,
            }
        )
    return found

"""The doctor's report: one :class:`Check` per line, ``ok``, ``warning`` or ``failure``, and the whole report.

Each check ends with one line of detail and, when it is not ok, one line
saying what to do; a :class:`DoctorReport` prints them and says whether any
failed (the command's exit status follows that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pointforge.errors import UserError
from pointforge.train.preflight import FAILURE, OK, WARNING, Finding

__all__ = ["Check", "DoctorReport", "from_finding", "guard"]


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def from_finding(finding: Finding) -> Check:
    """A preflight :class:`~pointforge.train.preflight.Finding` as one line of the report."""
    return Check(finding.check, finding.status, finding.detail, finding.fix)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == FAILURE for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARNING, FAILURE)}

    def text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=10)
        lines = ["pointforge doctor"]
        for c in self.checks:
            lines.append(f"  {c.status:8s} {c.name:{width}s}  {c.detail}")
            if c.fix and c.status != OK:
                lines.append(f"  {'':8s} {'':{width}s}  fix: {c.fix}")
        n = self.counts()
        lines.append(f"{n[OK]} ok, {n[WARNING]} warning(s), {n[FAILURE]} failure(s)")
        return "\n".join(lines)


def guard(name: str, fn: Callable[[], Any]) -> list[Check]:
    """Run one check; an unexpected error becomes a failure of that check, not of the doctor."""
    try:
        result = fn()
    except UserError as err:
        return [Check(name, FAILURE, str(err), "fix what the message names")]
    except Exception as err:
        return [Check(name, FAILURE, f"check crashed: {type(err).__name__}: {err}", "report this as a pointforge bug")]
    if result is None:
        return []
    return result if isinstance(result, list) else [result]

"""A whole dataset through the pipeline: every case into ``out/<case_id>/``, resumable, failures recorded."""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pointforge.atomic import atomic_write_text
from pointforge.data.skulls.layouts import list_cases
from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.errors import ConfigError, DataError, UserError, disk_full_cause
from pointforge.implant.case import generate_case
from pointforge.implant.models import Models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.printable import PrintOptions, write_printable
from pointforge.implant.view import PLOTLY_JS
from pointforge.implant.writer import case_done

__all__ = ["FolderCase", "FolderResult", "cases_of", "generate_folder"]


@dataclass
class FolderCase:
    case_id: str
    defect: str
    source: Path


def cases_of(root: str | os.PathLike, split: str = "test") -> list[FolderCase]:
    """The defective skulls to process under ``root``.

    A prepared dataset (``cases.csv``): the cases of ``split``, each read from the
    raw volume its surface points were prepared from. A raw dataset in the
    SkullBreak or SkullFix layout: every defective skull (a raw dataset has no
    split: ``test``, the default, and ``all`` both mean every case there; asking
    for ``train`` or ``val`` is an error).
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder")
    if (root / "cases.csv").is_file():
        data = PreparedDataset(root)
        chosen = data.split(split, require=("defective",))
        if not chosen:
            raise DataError(f"{root}: the prepared dataset has no case in split '{split}'")
        out = []
        for case in chosen:
            source = data.meta(case.defective).get("source")
            if not source:
                raise DataError(f"{root}: case {case.case_id} does not record its source volume; re-run prepare")
            out.append(FolderCase(case.case_id, case.defect, Path(source)))
        return out
    if split not in ("all", "test"):
        raise ConfigError(
            f"{root} is a raw dataset, which has no {split} split; prepare it first "
            "(pointforge data prepare) or leave --split out to process every case"
        )
    _, raw = list_cases(root)
    cases = [FolderCase(c.case_id, c.defect, Path(c.defective)) for c in raw if c.defective is not None]
    if not cases:
        raise DataError(f"{root}: no defective skull found")
    return cases


@dataclass
class FolderResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # complete from an earlier run
    failed: dict[str, str] = field(default_factory=dict)
    printed: dict[str, str] = field(default_factory=dict)  # case → its print-ready STL, when one was asked for
    seconds: float = 0.0


def generate_folder(
    root: str | os.PathLike,
    out: str | os.PathLike,
    models: Models,
    options: GenerateOptions | None = None,
    *,
    split: str = "test",
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    step_progress: Callable[[str, int, int], None] | None = None,
    label: float | None = None,
    viewer_js: str | os.PathLike | None = None,
    printable: PrintOptions | None = None,
    pictures: bool = True,
) -> FolderResult:
    """Every case of ``root`` (see :func:`cases_of`) into ``out/<case_id>/``.

    Resumable: a case whose folder is complete is skipped. One failing case is
    logged and recorded and never stops the others. ``out/summary.json`` lists
    what was done, skipped and failed (with the error). ``progress(done, total)``
    counts cases, ``step_progress(stage, done, total)`` the steps within one
    (:func:`~pointforge.implant.case.generate_case`'s ``progress``). Every
    case's view.html loads one plotly.js, ``viewer_js`` (default ``out/plotly.min.js``); ``pictures=False``
    writes no preview.png and view.html.
    With ``printable``, every generated case (new or from an earlier run) also gets that print-ready STL
    (:func:`~pointforge.implant.printable.write_printable`, made once per setting); a case whose STL cannot
    be made is failed with the reason and keeps its implant.
    """
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    cases = cases_of(root, split)
    out = Path(out)
    viewer_js = Path(viewer_js) if viewer_js is not None else out / PLOTLY_JS
    result = FolderResult()
    if progress:
        progress(0, len(cases))  # the count starts now, not when the first case is done
    for k, case in enumerate(cases):
        target = out / case.case_id
        try:
            if case_done(target):
                result.skipped.append(case.case_id)
            else:
                generate_case(
                    case.source,
                    target,
                    models,
                    options,
                    overwrite=target.exists(),
                    title=f"{case.case_id} ({case.defect})" if case.defect else case.case_id,
                    progress=step_progress,
                    label=label,
                    viewer_js=viewer_js,
                    preview=pictures,
                    view=pictures,
                )
                result.done.append(case.case_id)
            if printable is not None:
                stl, _ = write_printable(target, case.source, printable)
                result.printed[case.case_id] = str(stl)
        except Exception as err:  # noqa: BLE001 - one case must never stop the others
            if disk_full_cause(err) is not None:
                raise  # ... except a full disk, which would fail every case after it the same way
            _record_failure(result, case.case_id, err, say)
        if progress:
            progress(k + 1, len(cases))
    result.seconds = time.perf_counter() - t0
    atomic_write_text(out / "summary.json", json.dumps(asdict(result), indent=1))
    return result


def _record_failure(result: FolderResult, case_id: str, err: Exception, say: Callable[[str], None]) -> None:
    """One line for a case that failed (a user's error as it is, anything else with its type and traceback)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, UserError):
        message = f"{type(err).__name__}: {message}"
        say(traceback.format_exc().rstrip())
    if case_id in result.done or case_id in result.skipped:
        message = f"print-ready STL: {message}"
    result.failed[case_id] = message
    say(f"case {case_id} failed: {message}")

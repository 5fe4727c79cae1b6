"""The demo's report as a web page a person reads: ``report.html``.

Plain HTML and CSS, no script of its own: the text and tables, the learning
curve, then a gallery with one card per held-out case (its four-view preview as
a thumbnail, its scores, a link to its turnable ``view.html``), the worst
cases with why each fails and their 3-D views embedded, and the commands that
reproduce each step at full scale. Every link is relative, so the output folder can be
moved or zipped whole and opened anywhere, offline.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pointforge.atomic import atomic_write_text

__all__ = ["CaseCard", "html_table", "write_report_html"]

STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.92em}td,th{border:1px solid #ccc;"
    "padding:4px 8px;text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}"
    "img{max-width:100%}pre{background:#f6f6f6;padding:0.6em;overflow-x:auto}"
    ".verdict{font-size:1.1em;background:#fff8e6;border-left:4px solid #f0a030;padding:0.6em 1em}"
    ".gallery{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:14px;margin:1em 0 2em}"
    ".card{border:1px solid #ddd;border-radius:6px;padding:8px;background:#fafafa}"
    ".card img{width:100%;border-radius:4px;background:white}.card a{text-decoration:none;color:#1a5fb4}"
    ".card .name{font-weight:600}.card .scores{font-size:0.9em;color:#444}"
    "iframe.view{width:100%;height:640px;border:1px solid #ccc;border-radius:6px}"
    "nav a{margin-right:1em}"
)


@dataclass
class CaseCard:
    """One case in the gallery: paths relative to the report's folder (``None`` where the file is absent)."""

    case_id: str
    scores: str  # one line, e.g. "DSC 0.71 (baseline 0.80)"
    thumbnail: str | None
    view: str | None


def html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def relative(path: Path, home: Path) -> str | None:
    """``path`` relative to ``home`` as a URL path, or None if there is no such file."""
    return Path(os.path.relpath(path, home)).as_posix() if path.is_file() else None


def _card(card: CaseCard) -> str:
    name = html.escape(card.case_id)
    thumb = (
        f"<img src='{html.escape(card.thumbnail)}' alt='{name}: skull and implant from four sides' loading='lazy'>"
        if card.thumbnail
        else "<p>(no preview)</p>"
    )
    if card.view:
        thumb = f"<a href='{html.escape(card.view)}' title='turn it in 3-D'>{thumb}</a>"
    link = f"<a href='{html.escape(card.view)}'>open the 3-D view →</a>" if card.view else "no 3-D view"
    return (
        f"<div class='card'>{thumb}<div class='name'>{name}</div>"
        f"<div class='scores'>{html.escape(card.scores)}</div><div>{link}</div></div>"
    )


def _gallery(cards: list[CaseCard]) -> list[str]:
    return [
        "<h2 id='cases'>Every test case (chosen models)</h2>",
        "<p>Each picture shows the defective skull (bone) and the implant coloured by how many proposals agree "
        "(yellow: all). Click a case to turn it in 3-D, switch each proposal on and off, and measure in mm.</p>",
        "<div class='gallery'>" + "".join(_card(c) for c in cards) + "</div>",
    ]


def _worst(worst: list[tuple[CaseCard, str]]) -> list[str]:
    """The worst cases, each with why it fails and its 3-D view embedded (drag to turn, scroll to zoom)."""
    if not worst:
        return []
    parts = [
        "<h2 id='worst'>The worst test cases, and why</h2>",
        "<p>The lowest DSC first. Each case's loss is split between the voxelizer and clean-up (what they lose "
        "given the true implant points) and PCDiff's points; drag a view to turn it, scroll to zoom.</p>",
    ]
    for card, why in worst:
        parts.append(f"<h3>{html.escape(card.case_id)}: {html.escape(card.scores)}</h3><p>{html.escape(why)}</p>")
        if card.view:
            parts.append(
                f"<iframe class='view' src='{html.escape(card.view)}' title='{html.escape(card.case_id)} in 3-D' "
                "loading='lazy'></iframe>"
            )
        else:
            parts.append("<p>(no 3-D view)</p>")
    return parts


def write_report_html(
    path: Path,
    intro: str,
    sections: list[tuple[str, str | None, str | None]],
    tables: dict[str, tuple[list[str], list[list[str]]]],
    cards: list[CaseCard],
    commands: list[tuple[str, str]],
    *,
    worst: Sequence[tuple[CaseCard, str]] = (),
    curve_image: str | None = "curve.png",
) -> Path:
    """The page at ``path``: ``sections`` are (title, table name or None, text or None), a section
    without a table is a highlighted verdict; the curve image follows the ``curve`` table; ``worst``:
    the worst cases' cards with why each fails, shown with their 3-D views after the gallery."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pointforge demo report</title>"
        f"<style>{STYLE}</style></head><body><h1>pointforge demo report</h1>",
        "<nav><a href='#cases'>cases</a><a href='#worst'>the worst, in 3-D</a>"
        "<a href='#reproduce'>reproduce on GPUs</a></nav>",
        f"<p>{html.escape(intro)}</p>",
    ]
    for title, key, text in sections:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if text:
            parts.append(
                f"<p class='verdict'>{html.escape(text)}</p>" if key is None else f"<p>{html.escape(text)}</p>"
            )
        if key:
            parts.append(html_table(*tables[key]))
        if key == "curve" and curve_image:
            parts.append(f"<img src='{html.escape(curve_image)}' alt='learning curve: mean DSC over training minutes'>")
    parts += _gallery(cards)
    parts += _worst(list(worst))
    parts.append("<h2 id='reproduce'>Reproduce at full scale on GPUs</h2>")
    parts += [f"<p>{html.escape(w)}:</p><pre>{html.escape(c)}</pre>" for w, c in commands]
    parts.append("</body></html>")
    atomic_write_text(path, "\n".join(parts))
    return path

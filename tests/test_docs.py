"""Every relative link in the README and docs/ points at something that exists.

A link to a file must name a file or folder of this repository; a link with a
``#fragment`` into a Markdown page must name one of that page's headings, with
the anchor GitHub makes from it. Links to other sites are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers import REPO

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        definition = _REFERENCE_DEF.match(line)
        if definition:
            found.append((number, definition.group(1)))
            continue
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """One line per relative link in ``page`` that resolves to nothing."""
    problems = []
    for number, target in links(page):
        if _SCHEME.match(target):
            continue  # another site: not checked here
        path_part, _, fragment = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if root.resolve() not in (dest, *dest.parents):
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where} names a path that does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{where} names no heading of {dest.name}")
    return problems


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert page.is_file()
    assert broken_links(page) == []


def test_the_readme_stays_short_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 120
    linked = {target.partition("#")[0] for _, target in links(REPO / "README.md")}
    pages = {str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")}
    assert pages and pages <= linked


def test_the_checker_finds_a_missing_file_a_missing_heading_and_an_escape(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Point budget, `fixed` batches\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "[ok](docs/other.md#point-budget-fixed-batches) [ok](#title) [web](https://example.org/x#y)\n"
        "[gone](docs/missing.md) ![img](docs/none.png)\n"
        "[bad anchor](docs/other.md#no-such-heading) [bad local](#nothing)\n"
        "[out](../outside.md)\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "`[in code](nowhere.md)`\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/missing.md names a path that does not exist",
        "docs/none.png names a path that does not exist",
        "docs/other.md#no-such-heading names no heading of other.md",
        "#nothing names no heading of README.md",
        "../outside.md leaves the repository",
    ]

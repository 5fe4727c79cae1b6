"""Every module, function and file of this repository that the README and the reference pages cite exists.

What counts as a citation:

* a dotted name that starts with ``pointforge.`` (``pointforge.implant.pipeline``,
  ``pointforge.tasks.pcdiff.frame.estimate_implant``), in prose or in code: the longest
  importable prefix is imported and the rest must be attributes of it;
* inside a code span, a dotted name that starts with a module of the package whose name
  is no config section (``implant.metrics``, ``devices.reuse_freed_memory``), read as
  ``pointforge.`` + the name;
* ``from pointforge.x import a, b`` in a code block: the module and each name;
* a path under ``pointforge/``, ``bench/`` or ``tests/`` ending in ``.py``, ``.yaml`` or
  ``.md``: the file must exist.

The journal (``docs/experiments/``) is not checked: its entries cite code as it was at
the commit each one names, including code removed since.
"""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import REPO

_DOTTED = re.compile(r"(?<![\w./-])pointforge(?:\.[A-Za-z_]\w*)+")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Top-level modules of the package that no config section shares a name with
# (``data.micro_batch`` and ``train.max_steps`` are config keys, not code).
_SHORT_ROOTS = "nn tasks inference implant upsampling ops serve cli devices atomic errors formats flock".split()
_SHORT = re.compile(r"^(?:" + "|".join(_SHORT_ROOTS) + r")(?:\.[A-Za-z_]\w*)+$")
_FROM_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(pointforge(?:\.\w+)*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))", re.MULTILINE
)
# A code span naming a file (``implant.nii.gz``, ``report.json``) is no code.
_FILE_SUFFIXES = set("nrrd nii gz stl png html json npy npz csv md py yaml las laz ply pt pth txt log db zip".split())
_PATH = re.compile(r"(?<![\w./-])((?:pointforge|bench|tests)/[\w./-]*\.(?:py|yaml|md))\b")


def reference_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def cited_names(text: str) -> set[str]:
    """The dotted names of code a page cites (module, or module and attributes)."""
    names = set(_DOTTED.findall(text))
    for span in _CODE_SPAN.findall(text):
        span = span.strip().rstrip("()")
        if _SHORT.match(span) and not _FILE_SUFFIXES & set(span.split(".")[1:]):
            names.add(f"pointforge.{span}")
    for module, in_brackets, on_the_line in _FROM_IMPORT.findall(text):
        names.add(module)
        imported = (in_brackets or on_the_line).replace("\n", " ").split(",")
        names.update(f"{module}.{name.split()[0]}" for name in imported if name.split())
    return names


def cited_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))


@cache
def resolve(name: str) -> str | None:
    """None when ``name`` is an importable module or an attribute chain of one, else why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name) and error.name.startswith("pointforge"):
                continue  # no such module: try a shorter prefix, the rest as attributes
            raise
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return f"{module_name} has no {'.'.join(parts[cut:])}"
            found = getattr(found, attribute)
        return None
    return "no such module"


def missing_citations(page: Path, root: Path = REPO) -> list[str]:
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(root)
    problems = [f"{where}: {name}: {why}" for name in sorted(cited_names(text)) if (why := resolve(name))]
    problems += [f"{where}: {path} does not exist" for path in sorted(cited_paths(text)) if not (root / path).exists()]
    return problems


@pytest.mark.parametrize("page", reference_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_module_function_and_file_exists(page):
    assert missing_citations(page) == []


def test_the_checker_reads_each_kind_of_citation_and_finds_what_is_missing(tmp_path):
    (tmp_path / "pointforge").mkdir()
    (tmp_path / "pointforge" / "here.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "Run `pointforge.implant.pipeline.generate_implant` or `implant.metrics` (config: `data.micro_batch`);\n"
        "pointforge.tasks.pcdiff.frame.no_such_function and `devices.no_such_thing`.\n"
        "See pointforge/here.py and pointforge/gone.py, bench/gone.py.\n"
        "```python\nfrom pointforge.inference.pcdiff import load_pcdiff, not_there\n```\n"
    )
    assert missing_citations(page, root=tmp_path) == [
        "page.md: pointforge.devices.no_such_thing: pointforge.devices has no no_such_thing",
        "page.md: pointforge.inference.pcdiff.not_there: pointforge.inference.pcdiff has no not_there",
        "page.md: pointforge.tasks.pcdiff.frame.no_such_function: pointforge.tasks.pcdiff.frame has no no_such_function",
        "page.md: bench/gone.py does not exist",
        "page.md: pointforge/gone.py does not exist",
    ]

"""The house rules that a linter does not check: module size, no second names, no upward string imports.

import-linter (``make test``) sees ``import`` statements only. These tests read
the source itself, so a shim that imports upward by string, a module that only
re-exports another, a deprecation alias or a module grown past its job fails
the suite the moment it appears.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project runs on 3.11 here
    tomllib = pytest.importorskip("tomli")

PACKAGE = REPO / "pointforge"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def layer_rank() -> dict[str, int]:
    """``pointforge.x`` → its layer's height (0 = lowest), from pyproject's import-linter contract."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    ranks: dict[str, int] = {}
    for height, layer in enumerate(reversed(contract["layers"])):
        for package in layer.split("|"):
            ranks[package.strip()] = height
    return ranks


def rank_of(dotted: str) -> int | None:
    """The layer of a module ``pointforge.a.b`` (that of its top package), None outside the layers."""
    parts = dotted.split(".")
    return layer_rank().get(".".join(parts[:2])) if len(parts) >= 2 else None


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes and functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


@cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once per session (the tests only read the trees)."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_the_layer_table_covers_every_top_level_package():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    missing = sorted(f"pointforge.{name}" for name in packages if f"pointforge.{name}" not in layer_rank())
    assert not missing, f"packages outside the layers contract in pyproject.toml: {missing}"


def test_no_module_is_longer_than_the_house_allows():
    long = {str(p.relative_to(REPO)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in modules():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_deprecation_shims_or_module_getattr():
    offenders = []
    for path in modules():
        tree = parsed(path)
        if "DeprecationWarning" in path.read_text():
            offenders.append(f"{path.relative_to(REPO)}: raises a DeprecationWarning (a second name for something)")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                offenders.append(f"{path.relative_to(REPO)}: module-level __getattr__ (a lazy alias)")
    assert not offenders, "\n".join(offenders)


def test_no_module_only_re_exports_another():
    """A module made of imports and ``__all__`` alone is a second name for its imports' home."""
    offenders = []
    for path in modules():
        body = [n for n in parsed(path).body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        imports = [n for n in body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pointforge")]
        rest = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom)) and not _is_all(n)]
        if imports and not rest:
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"re-export modules (import from the home module instead): {offenders}"


def _is_all(node: ast.stmt) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def test_package_inits_hold_no_imports_from_their_submodules_for_others():
    """``__all__`` of a package ``__init__`` lists only what that file itself defines."""
    offenders = []
    for path in PACKAGE.rglob("__init__.py"):
        tree = parsed(path)
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for node in tree.body:
            if _is_all(node) and isinstance(node.value, (ast.List, ast.Tuple)):
                names = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
                if names - defined:
                    offenders.append(f"{path.relative_to(REPO)}: {sorted(names - defined)}")
    assert not offenders, f"package __init__ re-exporting names defined elsewhere: {offenders}"


UPWARD_NAME = re.compile(r"pointforge(?:\.[a-z_0-9]+)+")


def test_no_string_names_a_module_of_a_higher_layer():
    """import-linter cannot see ``importlib.import_module("pointforge.x")`` or ``-m pointforge.x``; this can."""
    offenders = []
    for path in modules():
        own = rank_of(module_name(path))
        if own is None:
            continue
        tree = parsed(path)
        docs = docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for match in UPWARD_NAME.finditer(node.value):
                    target = rank_of(match.group(0))
                    if target is not None and target > own:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} names {match.group(0)}")
    assert not offenders, "string references to a higher layer:\n" + "\n".join(offenders)


def test_every_package_says_its_job():
    silent = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("__init__.py") if ast.get_docstring(parsed(p)) is None]
    assert not silent, f"packages without a docstring saying their job: {silent}"


def test_the_projects_own_deprecation_warnings_fail_the_run():
    """pyproject's filterwarnings turns a pointforge DeprecationWarning into an error in every test."""
    import warnings

    with pytest.raises(DeprecationWarning):
        warnings.warn("pointforge.something moved to pointforge.elsewhere", DeprecationWarning, stacklevel=1)

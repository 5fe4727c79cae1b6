"""Importing a script under bench/ as a module, for the bench tests."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Callable, Iterator

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def bench_module() -> Iterator[Callable[[str], ModuleType]]:
    """``bench_module("pipeline")`` imports bench/pipeline.py (bench/ on sys.path for the module's tests)."""
    bench = str(REPO / "bench")
    sys.path.insert(0, bench)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(bench)

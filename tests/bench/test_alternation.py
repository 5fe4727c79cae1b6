"""bench/_common.py's alternation harness: variants in turn, the order flipping each round, fresh processes."""

from __future__ import annotations

import pytest


def test_the_variants_take_turns_and_the_order_flips_each_round(bench_module):
    common = bench_module("_common")
    calls = []

    def measure(i, r):
        calls.append((i, r))
        return {"s": float(10 * i + r)}

    done = common.alternate(["a", "b", "c"], 3, measure)
    assert calls == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1), (0, 2), (1, 2), (2, 2)]
    assert done.runs["b"] == [{"s": 10.0}, {"s": 11.0}, {"s": 12.0}]
    assert done.median("b", "s") == 11.0 and done.median("c", lambda record: -record["s"]) == -21.0
    assert len(done.loads) == 3


def test_checkouts_are_this_one_then_the_other(bench_module, tmp_path):
    common = bench_module("_common")
    assert common.checkouts(None) == [("this checkout", common.ROOT)]
    assert common.checkouts(tmp_path / ".") == [("this checkout", common.ROOT), (str(tmp_path), tmp_path)]


def test_a_fresh_process_imports_pointforge_from_the_checkout_it_measures(bench_module, tmp_path):
    common = bench_module("_common")
    tree = tmp_path / "other"
    (tree / "pointforge").mkdir(parents=True)
    (tree / "pointforge" / "__init__.py").write_text("WHERE = 'other'\n")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\nimport _common, pointforge\nprint('not a record')\n"
        "print(json.dumps({'where': pointforge.WHERE, 'cwd': os.getcwd(), 'args': sys.argv[1:]}))\n"
    )
    assert common.fresh_process(probe, ["--x", "1"], tree) == {"where": "other", "cwd": str(tree), "args": ["--x", "1"]}
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nprint('{}')\nsys.exit('out of memory')\n")
    assert common.fresh_process(failing, [], tree, check=False) == {"error": "out of memory"}
    with pytest.raises(SystemExit, match=r"failing\.py: the measurement in .*other failed:\nout of memory"):
        common.fresh_process(failing, [], tree)

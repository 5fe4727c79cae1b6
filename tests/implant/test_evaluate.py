import json
import math
import re

import numpy as np
import pytest

from pointforge.data.volumes import read_binary_volume, write_volume
from pointforge.errors import DataError
from pointforge.implant.evaluate import evaluate_predictions, write_reports
from pointforge.implant.metrics import evaluate_case
from tests.helpers import run_cli, write_raw_dataset


def test_evaluate_finds_predictions_in_every_layout_and_aggregates(tmp_path):
    truth = write_raw_dataset(
        tmp_path / "truth", "skullbreak", n_skulls=2, spacing=(0.5, 0.5, 0.8), defects=("bilateral", "random_1")
    )
    pred = tmp_path / "pred"
    t = read_binary_volume(truth / "implant/bilateral/000.nrrd")
    # generate-style, dataset-style, flat; one case left missing.
    write_volume(pred / "bilateral/000/implant.nrrd", t)
    t1 = read_binary_volume(truth / "implant/bilateral/001.nrrd")
    shifted = np.roll(t1.data, 1, axis=0)
    write_volume(pred / "implant/bilateral/001.nrrd", t1.with_data(shifted))
    write_volume(pred / "random_1/000.nrrd", t.with_data(np.zeros_like(t.data)))
    ev = evaluate_predictions(pred, truth)
    assert ev.missing == ["random_1/001"]
    rows = {r["case_id"]: r for r in ev.rows}
    assert rows["bilateral/000"]["dsc"] == 1.0 and rows["bilateral/000"]["hd95"] == 0.0
    expect = evaluate_case(
        shifted, t1.data, read_binary_volume(truth / "defective_skull/bilateral/001.nrrd").data, (0.5, 0.5, 0.8)
    )
    assert rows["bilateral/001"]["hd95"] == pytest.approx(expect["hd95"]) and rows["bilateral/001"]["dsc"] < 1
    assert rows["random_1/000"]["dsc"] == 0.0 and math.isnan(rows["random_1/000"]["hd95"])
    assert ev.summary["bilateral"]["dsc"]["n"] == 2
    assert ev.summary["all"]["dsc"]["n"] == 3
    assert ev.summary["all"]["hd95"]["n"] == 2  # the undefined HD95 is left out of the mean, not zeroed
    paths = write_reports(ev, tmp_path / "report")

    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    data = json.loads(paths["json"].read_text(), parse_constant=reject)  # strict JSON: NaN written as null
    assert data["missing"] == ["random_1/001"]
    assert {r["case_id"]: r["hd95"] for r in data["cases"]}["random_1/000"] is None
    assert paths["csv"].read_text().count("\n") == 4


def test_a_bad_prediction_is_reported_per_case(tmp_path):
    truth = write_raw_dataset(tmp_path / "truth", "skullfix", n_skulls=2)
    write_volume(tmp_path / "pred/000/implant.nrrd", np.zeros((10, 10, 10), bool))
    t = read_binary_volume(truth / "implant/001.nrrd")
    write_volume(tmp_path / "pred/001/implant.nrrd", t)
    ev = evaluate_predictions(tmp_path / "pred", truth)
    rows = {r["case_id"]: r for r in ev.rows}
    assert "differs from the truth" in rows["000"]["error"] and math.isnan(rows["000"]["dsc"])
    assert rows["001"]["dsc"] == 1.0 and ev.summary["all"]["dsc"]["n"] == 1


def test_evaluate_errors(tmp_path):
    truth = write_raw_dataset(tmp_path / "truth", "skullfix", n_skulls=1)
    with pytest.raises(DataError, match="no such folder"):
        evaluate_predictions(tmp_path / "nothing", truth)


def test_the_printed_table_fits_80_columns_and_cases_are_counted(tmp_path, monkeypatch):
    defects = ("bilateral", "frontoorbital", "parietotemporal", "random_1", "random_2")
    truth = write_raw_dataset(tmp_path / "truth", "skullbreak", n_skulls=1, spacing=(0.4, 0.4, 0.4), defects=defects)
    for d in defects:
        t = read_binary_volume(truth / f"implant/{d}/000.nrrd")
        write_volume(tmp_path / f"pred/{d}/000/implant.nrrd", t.with_data(np.roll(t.data, 1, axis=0)))
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli("evaluate", tmp_path / "pred", "--truth", truth)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = [line for line in lines if not line.startswith("wrote ")]  # the paths at the end are as long as they are
    assert max(len(line) for line in table) <= 80, "\n".join(table)
    for group in (*defects, "all"):
        rows = [line for line in lines if f" {group} " in line]
        assert len(rows) == 2, (group, rows)  # a mean ± sd row and a median row, each on one line
        assert rows[0].count("±") == 3 and len(re.findall(r"\d+\.\d{2,3}", rows[1])) == 3, rows
    assert "scoring cases: 0/5 (0%)" in result.output and "scoring cases: 5/5 (100%)" in result.output  # plain lines

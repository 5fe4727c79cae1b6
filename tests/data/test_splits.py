"""Splits by skull id (the fixed real-skull split) and the shipped checksum list."""

import hashlib
import json

import pytest

from pointforge.data.prepare import prepare_dataset
from pointforge.data.skulls import checksums
from pointforge.data.skulls.splits import NAMED_SPLITS, assign_skulls, check_split
from pointforge.errors import ConfigError, DataError
from tests.helpers import write_raw_dataset


def test_id_split_assigns_named_skulls_and_leaves_out_the_rest():
    ids = [f"{i:03d}" for i in range(100)]
    got = assign_skulls(ids, "skullfix", seed=0)
    assert [k for k, v in got.items() if v == "test"] == [f"{i:03d}" for i in range(70, 80)]
    assert sum(v == "train" for v in got.values()) == 60 and sum(v == "val" for v in got.values()) == 10
    assert not any(f"{i:03d}" in got for i in range(80, 100))  # the release check is never assigned
    assert assign_skulls(ids, "skullfix", seed=0) == assign_skulls(ids, "skullfix", seed=7)  # no randomness
    mixed = assign_skulls(["001", "002", "abc"], "train=001+abc,test=002", seed=0)
    assert mixed == {"001": "train", "002": "test", "abc": "train"}
    # The tuning split keeps its test skulls out of the recipe's test skulls.
    tune = assign_skulls(ids, NAMED_SPLITS["skullfix-tune"], seed=0)
    assert not {k for k, v in tune.items() if v != "train"} & {k for k, v in got.items() if v == "test"}


@pytest.mark.parametrize(
    "text, words",
    [
        ("train=000-059,oops=1-2", "not split=ids"),
        ("train=059-000", "backwards"),
        ("train=000-010,test=005-012", "several splits"),
        ("train=1,train=2", "twice"),
        ("0.5,x", "not numbers"),
    ],
)
def test_bad_splits_are_one_line(text, words):
    with pytest.raises(ConfigError, match=words) as err:
        if "several" in words:
            assign_skulls(["007"], text, seed=0)
        else:
            check_split(text)
    assert "\n" not in str(err.value)


def test_prepare_with_an_id_split_never_reads_unnamed_skulls(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=3)
    (raw / "defective_skull/002.nrrd").write_bytes(b"not a volume")  # would fail if it were read
    res = prepare_dataset(raw, tmp_path / "prep", n_points=2000, split="train=000,test=001", workers=1)
    assert res.ok and [(c.case_id, c.split) for c in res.cases] == [("000", "train"), ("001", "test")]
    assert not list((tmp_path / "prep").rglob("002.*"))
    info = json.loads((tmp_path / "prep/dataset.json").read_text())
    assert info["split"] == "train=000,test=001" and info["split_ratios"] is None
    with pytest.raises(ConfigError, match="names none"):
        prepare_dataset(raw, tmp_path / "prep2", n_points=2000, split="train=050-059", workers=1)


def test_verify_reports_missing_and_changed_files(tmp_path, monkeypatch):
    (tmp_path / "implant").mkdir()
    good, bad = tmp_path / "implant/000.nrrd", tmp_path / "implant/001.nrrd"
    good.write_bytes(b"good")
    bad.write_bytes(b"tampered")
    listed = {
        "implant/000.nrrd": hashlib.sha256(b"good").hexdigest(),
        "implant/001.nrrd": hashlib.sha256(b"bad").hexdigest(),
        "implant/002.nrrd": hashlib.sha256(b"gone").hexdigest(),
    }
    monkeypatch.setattr(checksums, "known_checksums", lambda name: listed)
    result = checksums.verify(tmp_path)
    assert (result.ok, result.changed, result.missing) == (
        ["implant/000.nrrd"],
        ["implant/001.nrrd"],
        ["implant/002.nrrd"],
    )
    assert not result.passed
    with pytest.raises(DataError, match="no such folder"):
        checksums.verify(tmp_path / "nowhere")


def test_shipped_skullfix_list_names_only_the_recipes_skulls():
    listed = checksums.known_checksums("skullfix")
    assert len(listed) == 240
    skulls = {rel.split("/")[1][:3] for rel in listed}
    assert skulls == {f"{i:03d}" for i in range(80)}
    assert all(len(d) == 64 for d in listed.values())

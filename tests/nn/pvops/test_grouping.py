"""Grouping and gather against upstream's kernels (fixture)."""

from __future__ import annotations

import pytest
import torch

from pointforge.nn.pvops.grouping import gather, grouping
from tests.nn.pvops.cases import close

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("op", ["grouping", "gather"])
def test_grouping_and_gather_match_upstream(ops, op):
    entry = ops[op]
    features = entry["inputs"]["features"].clone().requires_grad_()
    fn = grouping if op == "grouping" else gather
    out = fn(features, entry["inputs"]["indices"])
    assert torch.equal(out, entry["out"])
    out.backward(entry["grad_out"])
    close(features.grad, entry["grad_features"])
    if op == "grouping":  # the fixture's -1 index must read as 0
        assert (entry["inputs"]["indices"] < 0).any()

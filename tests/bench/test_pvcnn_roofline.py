"""bench/pvcnn_roofline.py: the forward's floor from each category's work and the machine's peaks."""

from __future__ import annotations

import pytest
import torch

PEAKS = {"matmul_gflops": 100.0, "conv3d_gflops": 50.0, "copy_gbs": 10.0}


@pytest.fixture(scope="module")
def roofline(bench_module):
    return bench_module("pvcnn_roofline")


def test_floor_sums_each_category_at_its_roof(roofline):
    record = {
        "forward_s": 3.0,
        "forward": {
            "seconds": {roofline.CONV: 1.0, "GroupNorm": 0.5, "point MLPs": 0.4, "ball query": 0.2},
            "flops": {roofline.CONV: 20e9, "GroupNorm": 0.1e9, "point MLPs": 30e9},
            "bytes": {roofline.CONV: 1e9, "GroupNorm": 2e9, "point MLPs": 1e9},
        },
    }
    floor = roofline.forward_floor(record, PEAKS)
    # Convolutions at the conv peak (0.4 s, not the product peak's 0.2 s); GroupNorm bound
    # by bytes (0.2 s); the MLPs by FLOPs (0.3 s); ball query, with no work model, as measured.
    assert floor["counted_floor_s"] == pytest.approx({roofline.CONV: 0.4, "GroupNorm": 0.2, "point MLPs": 0.3})
    assert floor["uncounted_measured_s"] == {"ball query": 0.2}
    assert floor["floor_s"] == pytest.approx(1.1)
    assert floor["forward_over_floor"] == pytest.approx(3.0 / 1.1)


def test_floor_of_a_real_tiny_forward(roofline):
    record = roofline.run_case("tiny", 1, torch.device("cpu"), False, False)
    floor = roofline.forward_floor(record, PEAKS)
    counted = floor["counted_floor_s"]
    assert roofline.CONV in counted and "GroupNorm" in counted and "FPS" in counted
    assert "ball query" in floor["uncounted_measured_s"]
    assert all(v > 0 for v in counted.values())
    assert floor["floor_s"] == pytest.approx(sum(counted.values()) + sum(floor["uncounted_measured_s"].values()))

"""An upsampling request too large for memory is refused before the network runs, naming the most points that fit."""

from __future__ import annotations

import numpy as np
import pytest

from pointforge.errors import ConfigError
from pointforge.nn.upsampler import UpsamplerConfig, build_upsampler
from pointforge.upsampling.pipeline import check_upsample_memory, upsample_cloud, upsample_memory_bytes


def test_upsample_estimate_grows_with_points_and_width_and_names_the_most_that_fit():
    tiny, paper = UpsamplerConfig.preset("tiny"), UpsamplerConfig.preset("paper")
    assert upsample_memory_bytes(tiny, 2000) == 2 * upsample_memory_bytes(tiny, 1000)
    assert upsample_memory_bytes(paper, 1000) > 4 * upsample_memory_bytes(tiny, 1000)
    per = upsample_memory_bytes(tiny, 1)
    check_upsample_memory(tiny, 1000, "cpu", budget=1000 * per)
    with pytest.raises(ConfigError, match=r"upsampling 1,001 points at once .* at most 1,000 points fit"):
        check_upsample_memory(tiny, 1001, "cpu", budget=1000 * per + per - 1)


def test_a_cloud_larger_than_memory_is_refused_before_the_network_runs():
    net = build_upsampler("tiny")
    huge = upsample_memory_bytes(net.config, 1)
    # 2**62 bytes worth of points is more than any machine has; the check runs before the array is even read.
    n = 2**62 // huge + 1
    xyz = np.broadcast_to(np.zeros((1, 3)), (n, 3))  # a view: no memory behind it
    with pytest.raises(ConfigError, match=r"at most [\d,]+ points fit: split the cloud"):
        upsample_cloud(net, xyz)

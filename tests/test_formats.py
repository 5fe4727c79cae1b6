"""The one JSON cleaner (one NaN policy) and the one byte format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from pointforge.formats import format_bytes, json_safe


def test_json_safe_writes_undefined_numbers_as_null_everywhere():
    data = {
        "a": math.nan,
        "b": (1, float("inf")),
        "c": np.float32(2.5),
        "d": Path("x/y"),
        "e": np.arange(2),
        "f": torch.tensor(-math.inf),
        3: [np.int64(4)],
    }
    out = json_safe(data)
    assert out == {"a": None, "b": [1, None], "c": 2.5, "d": "x/y", "e": [0, 1], "f": None, "3": [4]}
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON

    class Report:
        def __json__(self):
            return {"x": math.nan}

    assert json_safe([Report()]) == [{"x": None}]


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 5 * 1024**3, 3 * 1024**5)] == [
        "-",
        "0 B",
        "1023 B",
        "1.5 KB",
        "5.0 GB",
        "3072.0 TB",
    ]

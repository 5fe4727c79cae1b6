"""PVCNN2's evaluation in per-sample chunks: the whole batch's output, and only in evaluation."""

from __future__ import annotations

import pytest
import torch

from pointforge.errors import ConfigError
from pointforge.nn.pvcnn import PVCNN2

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(tiny, **kwargs) -> PVCNN2:
    model = PVCNN2("tiny", **kwargs)
    model.load_state_dict(tiny["state_dict"], strict=True)
    return model.eval()


def _passes(model: PVCNN2, monkeypatch) -> list[int]:
    """The batch sizes of the passes ``model`` makes from now on."""
    sizes: list[int] = []
    inner = model._forward

    def recorded(x, temb):
        sizes.append(x.shape[0])
        return inner(x, temb)

    monkeypatch.setattr(model, "_forward", recorded)
    return sizes


def test_chunks_give_the_whole_batch_output_and_upstream_s(tiny):
    x = torch.cat([tiny["x"], tiny["x"].flip(0)])  # 4 samples of 1,024 points
    t = torch.cat([tiny["t"], tiny["t"].flip(0)])
    whole = _model(tiny)
    with torch.no_grad():
        expected = whole(x, t)
        for per_chunk in (1, 3):
            chunked = _model(tiny, eval_chunk_points=per_chunk * x.shape[2])
            got = chunked(x, t)
            # Float rounding only: oneDNN's 3-D convolutions and the matrix products round by
            # batch size (3.6e-5 here at most), within the upstream fixture's tolerance.
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got[:2], tiny["y"], atol=1e-4, rtol=1e-4)
        double = _model(tiny, eval_chunk_points=1).double()
        torch.testing.assert_close(double(x.double(), t), whole.double()(x.double(), t), atol=1e-12, rtol=1e-12)


def test_only_evaluation_is_chunked(tiny, monkeypatch):
    model = _model(tiny, eval_chunk_points=2 * 1024 + 5)
    passes = _passes(model, monkeypatch)
    x = torch.cat([tiny["x"], tiny["x"], tiny["x"][:1]])
    t = torch.cat([tiny["t"], tiny["t"], tiny["t"][:1]])
    with torch.no_grad():
        model(x, t)
    assert passes == [2, 2, 1]  # as many samples as fit the budget, then the rest
    passes.clear()
    model(x, t)  # autograd records: one pass, whatever the budget
    assert passes == [5]
    passes.clear()
    model.train()
    with torch.no_grad():
        model(x, t)  # training mode: dropout's masks must be the whole batch's draws
    assert passes == [5]
    passes.clear()
    model.eval().eval_chunk_points = 100  # smaller than one sample: one sample per pass
    with torch.no_grad():
        model(x, t)
    assert passes == [1] * 5
    assert "evaluation in chunks of 100 points" in repr(model)


def test_whole_batches_without_a_budget_and_bad_budgets_refused(tiny, monkeypatch):
    model = _model(tiny)
    passes = _passes(model, monkeypatch)
    with torch.no_grad():
        model(tiny["x"], tiny["t"])
    assert passes == [2]
    for bad in (0, -3, True):
        with pytest.raises(ConfigError, match="eval_chunk_points"):
            PVCNN2("tiny", eval_chunk_points=bad)

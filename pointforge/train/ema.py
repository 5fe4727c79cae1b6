"""Exponential moving average of a model's weights."""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from pointforge.train.checkpoint.format import load_model_state, to_cpu


class EMA:
    """``ema = decay·ema + (1-decay)·weights`` after every optimizer step; buffers are copied.

    The averaged module's floating-point parameters are views into one flat tensor per
    dtype and device, so an update is one ``cat`` of the model's parameters and one
    ``lerp_``: the tiny PCDiff network's ~300 small tensors cost about three times as
    much per step as a per-tensor ``_foreach_lerp_`` on CPU (docs/experiments/benchmarks.md). The formula is the same; only
    which elements take the vectorised path changes, which can move a result by a
    rounding (float32 on the development machine: bit for bit; float64: within 1 ulp). Should something replace a parameter's
    storage (``module.to(...)``), the flat tensors are rebuilt from the parameters.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)
        self._flatten()

    def _flatten(self) -> None:
        """Group the floating-point parameters by (dtype, device), each group's into one flat tensor."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        params = list(self.module.parameters())
        for index, param in enumerate(params):
            if param.dtype.is_floating_point:
                groups.setdefault((param.dtype, param.device), []).append(index)
        self._groups: list[tuple[list[int], torch.Tensor]] = []
        for indices in groups.values():
            flat = torch.cat([params[i].detach().reshape(-1) for i in indices])
            offset = 0
            for i in indices:
                n = params[i].numel()
                params[i].data = flat[offset : offset + n].view_as(params[i])
                offset += n
            self._groups.append((indices, flat))
        # One parameter per group tells whether something gave the module new storage
        # (``module.to`` replaces every parameter's); checking all would loop over every parameter each step.
        self._anchors = [(params[indices[0]], params[indices[0]].data_ptr()) for indices, _ in self._groups]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        if any(param.data_ptr() != pointer for param, pointer in self._anchors):
            self._flatten()
        params = list(model.parameters())
        for indices, flat in self._groups:
            # One C++ call for the ~300 views and their concatenation.
            current = torch._utils._flatten_dense_tensors([params[i] for i in indices])
            flat.lerp_(current, 1.0 - self.decay)
        for ema_buf, buf in zip(self.module.buffers(), model.buffers()):
            ema_buf.copy_(buf)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Copies: the parameters are views of the flat tensors, which a saved view would drag along.
        return to_cpu({k: v.clone() for k, v in self.module.state_dict().items()})

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_model_state(self.module, state)

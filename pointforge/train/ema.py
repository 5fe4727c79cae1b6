"""Exponential moving average of a model's weights."""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from pointforge.train.checkpoint import load_model_state, to_cpu


class EMA:
    """``ema = decay·ema + (1-decay)·weights`` after every optimizer step; buffers are copied."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_params = [p for p in self.module.parameters()]
        params = [p.detach() for p in model.parameters()]
        floating = [(e, p) for e, p in zip(ema_params, params) if e.dtype.is_floating_point]
        if floating:
            torch._foreach_lerp_([e for e, _ in floating], [p for _, p in floating], 1.0 - self.decay)
        for ema_buf, buf in zip(self.module.buffers(), model.buffers()):
            ema_buf.copy_(buf)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return to_cpu(self.module.state_dict())

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_model_state(self.module, state)

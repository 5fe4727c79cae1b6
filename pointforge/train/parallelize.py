"""How the model runs on its device: precision, memory format, and the DDP / ``torch.compile`` wrapper.

As torchtitan's ``parallelize_fn``: the bare model a task builds goes in, the
model a training step calls comes out; checkpoints and EMA keep using the
bare one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pointforge.config import TrainConfig
from pointforge.errors import ConfigError, DeviceError
from pointforge.train.dist import DistEnv, report


def set_precision(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """Apply ``perf.threads`` and ``perf.tf32``; return the autocast dtype ``perf.amp`` asks for (None: full precision)."""
    perf = cfg.perf
    if perf.threads:
        torch.set_num_threads(perf.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = perf.tf32
        torch.backends.cudnn.allow_tf32 = perf.tf32
    return amp_dtype(cfg, device)


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``perf.amp`` asks for on ``device`` (None: full precision)."""
    amp = cfg.perf.amp
    if amp == "none":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise ConfigError(
                "perf.amp=fp16 needs a CUDA device (it relies on a GradScaler); use perf.amp=bf16 on the CPU"
            )
        return torch.float16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"perf.amp=bf16 is not supported by {torch.cuda.get_device_name(device)}; use perf.amp=fp16")
    return torch.bfloat16


def to_channels_last(model: nn.Module) -> None:
    """``perf.channels_last``: 4-d and 5-d parameters in channels-last memory format."""
    for param in model.parameters():
        if param.dim() == 4:
            param.data = param.data.contiguous(memory_format=torch.channels_last)
        elif param.dim() == 5:
            param.data = param.data.contiguous(memory_format=torch.channels_last_3d)


def wrap_model(model: nn.Module, cfg: TrainConfig, env: DistEnv, where: dict[str, int]) -> nn.Module:
    """DDP and ``torch.compile`` around the bare ``model``; ``where`` is the step's position, for the DDP hook."""
    perf, device = cfg.perf, env.device
    train_model: nn.Module = model
    if env.distributed:
        ddp_kwargs: dict[str, Any] = {"find_unused_parameters": cfg.dist.find_unused_parameters}
        if device.type == "cuda":
            ddp_kwargs["device_ids"] = [device.index]
            ddp_kwargs["output_device"] = device.index
        train_model = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        # Marks the moment a rank leaves its forward pass, so a timeout can
        # tell a rank stuck computing from one waiting in the gradient all-reduce.
        # (Not under torch.compile, which would have to trace the hook.)
        if not perf.compile:
            model.register_forward_hook(lambda *_: report(env, "in backward (gradient all-reduce)", **where))
    if perf.compile:
        train_model = torch.compile(train_model)  # type: ignore[assignment]
    return train_model

"""PVCNN2 through ``torch.compile`` (Inductor) for the benches, in the one form that compiles and runs.

``torch.compile(model)`` as the engine's ``perf.compile=true`` does it fails on PVCNN2
(docs/experiments/benchmarks.md, "torch.compile on PVCNN2"): Dynamo traces into the index searches
(FPS, ball query, 3-NN, the voxel maps, the variable-length set-abstraction pooling),
whose ``.item()``, ``nonzero`` and ``bincount`` break the graph about 90 times and give
later graphs shapes that change from call to call; its automatic dynamic shapes then
recompile them symbolically and Inductor stops with a sympy error. Here those searches
run eagerly (``torch.compiler.disable``, a graph break at each call but nothing traced
inside), every graph is compiled for static shapes, the recompile limit is raised for
``PVCNN2._segment`` (one code object for every block), and Inductor draws random numbers
as eager PyTorch does, so dropout masks and losses compare step for step.
"""

from __future__ import annotations

from typing import Any

import torch


def compile_pvcnn(model: torch.nn.Module) -> Any:
    """``model`` (a PVCNN2 or a module around one) compiled with the index searches left eager."""
    import torch._dynamo
    import torch._inductor.config

    from pointforge.nn import pvcnn_blocks

    off = torch.compiler.disable
    for owner, name in (
        (pvcnn_blocks.VoxelMap, "__init__"),
        (pvcnn_blocks.SetAbstraction, "neighborhoods"),
        (pvcnn_blocks.SetAbstraction, "_pool_distinct"),
        (pvcnn_blocks.FeaturePropagation, "nearest"),
    ):
        setattr(owner, name, off(getattr(owner, name)))
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.fallback_random = True
    return torch.compile(model, dynamic=False)

"""Will a case fit? The memory one generate case needs, checked before anything runs.

The device holds PCDiff sampling every proposal in one batch (the fitted PVCNN2
model, :func:`pointforge.nn.pvcnn_memory.sampling_bytes`) and one voxelizer
DPSR solve (:func:`pointforge.nn.dpsr.dpsr_memory_bytes`); the host holds the
proposals' volumes. :func:`check_generate_memory` names the largest
``--ensemble`` that fits when the asked one does not.
"""

from __future__ import annotations

import math

from pointforge.devices import available_memory_bytes, release_freed_memory
from pointforge.errors import ConfigError
from pointforge.formats import format_bytes
from pointforge.implant.models import Models
from pointforge.implant.options import GenerateOptions
from pointforge.implant.voxelize import MAX_SOLVE_RESOLUTION
from pointforge.nn.dpsr import dpsr_memory_bytes
from pointforge.nn.dpsr_grid import normalize_resolution
from pointforge.nn.pvcnn_config import PVCNN2Config
from pointforge.nn.pvcnn_memory import sampling_bytes

__all__ = ["generate_memory_bytes", "check_generate_memory"]


def generate_memory_bytes(models: Models, options: GenerateOptions, shape: tuple[int, ...], ensemble: int) -> dict:
    """Estimated peak memory of one case with ``ensemble`` proposals: ``{"device": bytes, "host": bytes}``.

    ``device`` (the models' device): PCDiff sampling all proposals in one batch,
    plus one voxelizer DPSR solve at the chosen resolution (proposals are solved
    one at a time). ``host`` (numpy): per proposal its completed skull, its own
    implant and its row of the agreement stack (one byte per voxel each), plus
    the vote's counts and agreement map (uint16, float32).
    """
    cfg = models.pcdiff.config
    voxels = math.prod(shape)
    # Without a resolution the pipeline picks one per case (voxelize.solve_resolution): count the finest it may.
    res = normalize_resolution(options.voxel_resolution or MAX_SOLVE_RESOLUTION)
    solve = dpsr_memory_bytes(res, models.voxelizer_config.task.n_points) + math.prod(res) * 4
    network = getattr(models.pcdiff.model, "config", None)
    points = cfg.n_skull + cfg.n_implant
    sample = sampling_bytes(network, points, ensemble) if isinstance(network, PVCNN2Config) else 0
    host = ensemble * 3 * voxels + voxels * (2 + 4 + 4)
    return {"device": sample + solve, "host": host}


def check_generate_memory(
    models: Models, options: GenerateOptions, shape: tuple[int, ...], *, budget: dict | None = None
) -> None:
    """ConfigError before anything runs when ``options.ensemble`` proposals of a ``shape`` volume will not fit.

    ``budget`` (``{"device": bytes, "host": bytes}``) stands in for what the
    device and the host have available now. The message names the largest
    ``--ensemble`` that fits, or says that one proposal does not.
    """
    on_cpu = models.device.type == "cpu"
    if budget is None:
        # What earlier cases freed goes back to the system first: a CPU-loaded PCDiff keeps
        # freed blocks in the heap between passes (devices.reuse_freed_memory).
        release_freed_memory()
        host = available_memory_bytes("cpu")
        budget = {"device": host if on_cpu else available_memory_bytes(models.device), "host": host}

    def fits(n: int) -> bool:
        need = generate_memory_bytes(models, options, shape, n)
        if on_cpu:
            return need["device"] + need["host"] <= budget["host"]
        return need["device"] <= budget["device"] and need["host"] <= budget["host"]

    n = options.ensemble
    if fits(n):
        return
    need = generate_memory_bytes(models, options, shape, n)
    volume = f"{n} proposals of a {'x'.join(map(str, shape))} volume need about"
    if on_cpu:
        said = f"{volume} {format_bytes(need['device'] + need['host'])}, more than the {format_bytes(budget['host'])} available"
    else:
        said = (
            f"{volume} {format_bytes(need['device'])} on {models.device} and {format_bytes(need['host'])} of host "
            f"memory, more than is available ({format_bytes(budget['device'])} / {format_bytes(budget['host'])})"
        )
    lo, hi = 0, n  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo:
        raise ConfigError(f"{said}; use --ensemble {lo} or fewer")
    raise ConfigError(f"{said} even for one proposal; use a lower voxelizer resolution or a machine with more memory")

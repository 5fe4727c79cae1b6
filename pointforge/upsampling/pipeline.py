"""Densify points or a point cloud file with a trained upsampler.

::

    from pointforge.inference.upsampler import load_upsampler
    from pointforge.upsampling.pipeline import upsample_points, upsample_file

    upsampler = load_upsampler("runs/upsampler/small/checkpoints/best.pt", device="auto")
    dense = upsample_points(upsampler, sparse_xyz)          # float64 [r·N, 3], same frame as the input
    upsample_file("tile.laz", "tile_dense.laz", upsampler)   # keeps the tile's scales, offsets and CRS

Coordinates: a cloud is normalised exactly as the training pairs were (centre
and scale from the sparse cloud itself), run through the network and mapped
back in float64, so the output lies in the input's own frame (georeferenced
metres stay georeferenced metres). Written files keep the input's storage
precision (float32 stays float32); a LAS/LAZ output takes the input's scales,
offsets, point format, version and coordinate-reference records when the input
is LAS/LAZ too (the new points are quantised to those scales, which is what LAS
does), and millimetres around the data otherwise. Only coordinates are written:
the new points have no intensity, classification or colour.

Memory of a tiled run: with glibc's default, the arrays of one tile freed
stay in the C heap, in holes the next tile's arrays only partly reuse, so the
resident memory rose tile after tile (measured on 1 million points in 32
tiles of at most 45,000: a tile's peak rose from 1.0 to 1.6 GB and the
memory held between tiles from 0.6 to 1.1 GB). A tiled run therefore gives
every array of 4 MiB or more its own memory map (returned to the system when
freed; glibc ``mallopt``, for the rest of the process) and hands the heap's
free memory back after each tile (``malloc_trim``): the tiles' peaks then
stay level. Elsewhere than Linux with glibc both are skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union, cast

import numpy as np
import torch

from pointforge.data.pairs.normalization import PairNormalization, pair_normalization
from pointforge.data.pointio import LasGeometry, PointCloud, point_format, read_points, write_points
from pointforge.data.pointstream import CloudSource, cloud_writer, open_cloud
from pointforge.devices import available_memory_bytes, map_large_blocks, resolve_device
from pointforge.errors import ConfigError, DataError
from pointforge.formats import format_bytes
from pointforge.inference.upsampler import LoadedUpsampler, load_upsampler
from pointforge.nn.knn import knn_graph
from pointforge.nn.upsampler import NodeShuffleUpsampler, UpsamplerConfig
from pointforge.upsampling.baselines import BASELINES, upsample_baseline
from pointforge.upsampling.tiling import choose_tile_points, iter_tiles, tile_cloud, work_folder

__all__ = [
    "UpsampleResult",
    "upsample_cloud",
    "upsample_points",
    "upsample_file",
    "baseline_file",
    "upsample_memory_bytes",
    "check_upsample_memory",
]

LARGE_BLOCK_BYTES = 4 * 2**20  # arrays this large or larger: their own memory map, given back when freed


@dataclass
class UpsampleResult:
    input: Path
    output: Path
    points_in: int
    points_out: int
    seconds: float
    tiles: int = 1
    tile_sizes: tuple[int, ...] = ()  # points of each tile through the network, margins included


@torch.no_grad()
def upsample_cloud(
    model: NodeShuffleUpsampler,
    xyz: np.ndarray,
    *,
    normalization: str = "spacing",
    device: torch.device | str = "cpu",
    norm: Optional[PairNormalization] = None,
) -> np.ndarray:
    """Upsample one cloud in source coordinates: float64 ``[N, 3]`` in, float64 ``[r·N, 3]`` out.

    Normalises as the training pairs are (:func:`pointforge.data.pairs.normalization.pair_normalization`),
    or by ``norm`` when given (a tile takes the whole cloud's scale), builds the
    graph, runs the model in eval mode and maps the result back.
    """
    xyz = np.asarray(xyz, dtype=np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or len(xyz) == 0:
        raise DataError(f"cloud to upsample must be a non-empty [N, 3] array, got shape {xyz.shape}")
    check_upsample_memory(model.config, len(xyz), device)
    centred = torch.from_numpy(xyz - xyz.min(axis=0))
    edges = knn_graph(centred, model.config.k)
    norm = norm or pair_normalization(xyz, normalization, edges.numpy())
    was_training = model.training
    model.eval()
    try:
        pos = torch.from_numpy(norm.apply(xyz)).to(device)
        out = model(pos, None, edges.to(device))
    finally:
        model.train(was_training)
    return norm.inverse(out.points)


def upsample_points(
    model: Union[LoadedUpsampler, NodeShuffleUpsampler],
    xyz: np.ndarray,
    *,
    normalization: str = "spacing",
    device: str | torch.device | None = None,
) -> np.ndarray:
    """Densify one cloud: ``xyz [N, 3]`` in, float64 ``[r·N, 3]`` out, in the input's frame.

    ``model`` is what :func:`load_upsampler` returns (its normalisation and
    device are used) or a bare network (then ``normalization`` and ``device``,
    default the model's own, apply).
    """
    if isinstance(model, LoadedUpsampler):
        net, normalization, where = (
            cast(NodeShuffleUpsampler, model.model),
            model.normalization,
            model.device if device is None else resolve_device(device),
        )
    elif isinstance(model, NodeShuffleUpsampler):
        net = model
        where = resolve_device(device) if device is not None else next(net.parameters()).device
    else:
        raise TypeError(
            f"upsample_points needs a LoadedUpsampler (from load_upsampler) or NodeShuffleUpsampler, got {type(model).__name__}"
        )
    points = np.asarray(xyz)
    if points.ndim != 2 or points.shape[1] != 3 or len(points) == 0:
        raise DataError(f"points to upsample must be a non-empty [N, 3] array, got shape {points.shape}")
    if not np.isfinite(points).all():
        raise DataError("points to upsample hold NaN or infinite coordinates; clean them first")
    net.to(where)
    return upsample_cloud(net, points, normalization=normalization, device=where)


def upsample_file(
    input: Union[str, Path],
    output: Union[str, Path],
    model: Union[LoadedUpsampler, str, Path],
    *,
    device: str | torch.device = "auto",
    tile_points: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> UpsampleResult:
    """Read ``input`` (npy/ply/las/laz), densify it, write ``output`` (any of those, atomically).

    ``model``: a loaded upsampler or a checkpoint path. Everything a user can
    get wrong (paths, suffixes, the checkpoint) is checked before the network runs.
    A cloud of at most ``tile_points`` points (None: 100,000, or fewer when
    memory is short; :func:`~pointforge.upsampling.tiling.choose_tile_points`)
    is upsampled in one pass; a larger one in overlapping tiles, streamed from
    and to disk (:mod:`pointforge.upsampling.tiling`), its points written tile by
    tile. ``progress(done, total)`` is called after each tile.
    """
    src, dst = _check_paths(input, output)
    out_format = point_format(dst)
    upsampler = model if isinstance(model, LoadedUpsampler) else load_upsampler(model, device)
    start = time.perf_counter()
    source = open_cloud(src)
    if source.count == 0:
        raise DataError(f"{src}: point cloud is empty; nothing to upsample")
    config = cast(NodeShuffleUpsampler, upsampler.model).config
    available = available_memory_bytes(upsampler.device)
    budget = choose_tile_points(config.hidden, config.ratio, tile_points, available)
    if source.count > budget:
        sizes = _upsample_tiled(source, dst, upsampler, budget, progress)
    else:
        cloud = read_points(src)
        dense = upsample_points(upsampler, cloud.xyz)
        las = None
        if out_format in ("las", "laz"):
            las = cloud.las or LasGeometry.around(dense)
        write_points(dst, PointCloud(xyz=dense, dtype=cloud.dtype, las=las))
        sizes = (source.count,)
        if progress is not None:
            progress(1, 1)
    return UpsampleResult(
        input=src,
        output=dst,
        points_in=source.count,
        points_out=source.count * config.ratio,
        seconds=time.perf_counter() - start,
        tiles=len(sizes),
        tile_sizes=sizes,
    )


def _check_paths(input: Union[str, Path], output: Union[str, Path]) -> tuple[Path, Path]:
    src, dst = Path(input), Path(output)
    point_format(src)
    point_format(dst)
    if not src.is_file():
        raise DataError(f"{src}: no such point cloud file; check the path")
    if dst.exists() and dst.resolve() == src.resolve():
        raise DataError(f"{dst}: the output would overwrite the input; choose another --out path")
    if dst.is_dir():
        raise DataError(f"{dst} is a folder; give --out a file name ending in .npy, .ply, .las or .laz")
    return src, dst


def baseline_file(
    input: Union[str, Path], output: Union[str, Path], method: str, ratio: int, *, workers: int = 1
) -> UpsampleResult:
    """``upsample_file`` with a geometric baseline (:mod:`pointforge.upsampling.baselines`) instead of a network.

    The whole cloud is read and densified at once (a k-d tree and ``k``
    neighbours per point: about 200 bytes per point); the output keeps the
    input's storage precision and LAS geometry, as :func:`upsample_file` does.
    """
    src, dst = _check_paths(input, output)
    if method not in BASELINES:
        raise ConfigError(f"unknown method {method!r}; choose model or one of {', '.join(BASELINES)}")
    start = time.perf_counter()
    cloud = read_points(src)
    if len(cloud) == 0:
        raise DataError(f"{src}: point cloud is empty; nothing to upsample")
    dense = upsample_baseline(method, cloud.xyz, ratio, workers=workers)
    las = (cloud.las or LasGeometry.around(dense)) if point_format(dst) in ("las", "laz") else None
    write_points(dst, PointCloud(xyz=dense, dtype=cloud.dtype, las=las))
    return UpsampleResult(src, dst, len(cloud), len(dense), time.perf_counter() - start)


def _upsample_tiled(
    source: CloudSource,
    dst: Path,
    upsampler: LoadedUpsampler,
    tile_points: int,
    progress: Optional[Callable[[int, int], None]],
) -> tuple[int, ...]:
    """Tile, upsample tile by tile, append the core points' children to ``dst``; the tiles' sizes."""
    net = cast(NodeShuffleUpsampler, upsampler.model).to(upsampler.device)
    config = net.config
    map_large_blocks(LARGE_BLOCK_BYTES)  # tile after tile, the heap would keep the holes of each (module docs)

    def run(xyz: np.ndarray, norm: PairNormalization) -> np.ndarray:
        return upsample_cloud(net, xyz, norm=norm, device=upsampler.device)

    with work_folder(dst) as folder:
        tiled = tile_cloud(
            source,
            folder,
            tile_points=tile_points,
            k=config.k,
            hops=config.feature_layers + 2,
            normalization=upsampler.normalization,
        )
        las = None
        if point_format(dst) in ("las", "laz"):
            las = source.las or LasGeometry.around(tiled.bounds)
        total = len(tiled.plan.tiles)
        with cloud_writer(dst, source.count * config.ratio, dtype=source.dtype, las=las) as write:
            for done, (_, children) in enumerate(iter_tiles(tiled, run, config.ratio), start=1):
                write(children)
                if progress is not None:
                    progress(done, total)
    return tuple(tile.halo_points for tile in tiled.plan.tiles)


# --------------------------------------------------------------------------- memory


def upsample_memory_bytes(config: UpsamplerConfig, n_points: int) -> int:
    """Estimated peak memory of upsampling ``n_points`` at once (float32, no gradients).

    Counted per input point, with ``e = 2k`` graph edges each (the symmetrised
    kNN graph) and ``C = hidden``: the graph (int64) and the node features of
    points and children; three E×C tensors alive at once in a point-transformer
    block; the shuffle's keys and values (E×r·C each); and the refinement over
    the children's ``r·e + r(r−1)`` edges per point (edge features and
    messages, E×C each, and the int64 child graph). Measured on the CPU (peak
    RSS growth, 50,000 points, tiny and small presets) it lies 5-10% above.
    """
    c, r, e = config.hidden, config.ratio, 2 * config.k
    child_edges = r * e + r * (r - 1)
    per_point = (
        2 * e * 8  # the graph
        + 8 * c * 4 * (1 + r)  # node features of the points and their children
        + 3 * e * c * 4  # a point-transformer block's messages
        + 2 * e * r * c * 4  # node shuffle attention
        + child_edges * (2 * c * 4 + 2 * 8)  # refinement over the child graph
    )
    return int(n_points) * per_point


def check_upsample_memory(
    config: UpsamplerConfig, n_points: int, device: torch.device | str, *, budget: int | None = None
) -> None:
    """ConfigError before the network runs when ``n_points`` will not fit, naming the most points that do."""
    need = upsample_memory_bytes(config, n_points)
    budget = available_memory_bytes(device) if budget is None else budget
    if need <= budget:
        return
    most = budget // max(upsample_memory_bytes(config, 1), 1)
    raise ConfigError(
        f"upsampling {n_points:,} points at once needs about {format_bytes(need)} on {torch.device(device)}, more than "
        f"the {format_bytes(budget)} available; at most {most:,} points fit: split the cloud into parts of that size"
    )

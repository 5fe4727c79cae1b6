"""Node-shuffle attention upsampler: a sparse cloud of N points in, r·N points out.

Architecture: NodeShuffle upsampling (PU-GCN, Qian et al., CVPR 2021) over
Point Transformer features (Zhao et al., ICCV 2021); all graph layers are
PyG's, all clouds of a batch one disjoint graph (sorted ``batch`` vector):

1. Graph: the k-NN graph of the sparse points (k = 10), symmetrised
   (:func:`pointforge.nn.knn.knn_graph`); a dataset may pass it precomputed.
2. Input features, translation-invariant so that georeferenced and
   tile-sized coordinates do not matter: each point's offset from the centroid
   of its neighbours and its mean distance to them, embedded linearly.
3. Feature extraction: ``feature_layers`` pre-norm residual
   :class:`~torch_geometric.nn.PointTransformerConv` blocks (vector attention
   over relative positions).
4. Node shuffle: one multi-head :class:`~torch_geometric.nn.TransformerConv`
   maps each point's C features to r·C, reshaped to r children of C features
   (child ``p·r + i`` is copy ``i`` of point ``p``, so each cloud's children stay
   contiguous). A linear head gives each child a coarse offset.
5. Refinement: children are joined to the same-numbered children of their
   parent's neighbours and to their siblings; a relative-position MLP encodes
   the coarse displacement along every such edge as the edge feature of a
   final multi-head TransformerConv.
6. Decoding: an MLP turns each child's features into a fine offset. Output =
   each child's start + coarse offset + fine offset.

Where the children start (``start``): ``input``, on their parent (the input
point repeated r times); or ``plane``, a local-surface fit computed from the
same graph (:func:`plane_start`): the parent projected onto the least-squares
plane of itself and its neighbours, and its other r − 1 children on that plane
at half its mean neighbour distance. With ``plane`` the network only learns a
correction to a geometric upsampler (the ``plane`` baseline of
:mod:`pointforge.upsampling.baselines`, with deterministic child
directions instead of seeded random ones); with its output heads near zero,
as initialised, it starts out as that baseline. The start uses one hop of the
graph, which the refinement stage's reach already covers, so a tiled run's
margin is unchanged. ``plane_k``: the plane (and the children's distance) from
the point and only its ``plane_k − 1`` nearest graph neighbours, as the
baseline takes its ``k`` nearest points; the symmetrised graph also holds the
points that count this one among *their* nearest, which on uneven real lidar
(tree crowns, multiple returns) tilt the plane (measured in docs/experiments/upsampler.md).

``gate``: each child's offset (coarse plus fine) is scaled by a sigmoid of
its features, ``output = start + g · offset``, so where the network cannot
improve on its geometric start it can keep it exactly (g → 0) instead of having
to learn offsets that cancel; it adds ``C + 1`` weights.

``heads``, ``concat``, ``beta`` and ``dropout`` configure both attention stages
as in PyG's TransformerConv. Normalisation is LayerNorm (per point): batch
statistics would couple the clouds of a batch and make one cloud's output
depend on its batch-mates. The module knows nothing about devices or ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor, nn

from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import check_batch, knn_graph
from pointforge.nn.presets import preset

__all__ = [
    "UpsamplerConfig",
    "PRESETS",
    "STARTS",
    "Upsampled",
    "NodeShuffleUpsampler",
    "build_upsampler",
    "child_graph",
    "training_elements",
    "training_step_bytes",
    "plane_start",
    "nearest_edges",
]

STARTS = ("input", "plane")


@dataclass(frozen=True)
class UpsamplerConfig:
    """Hyper-parameters; see :data:`PRESETS` for named sizes."""

    ratio: int = 2  # r: output points per input point
    k: int = 10  # neighbours per point before symmetrisation
    hidden: int = 64  # C: feature width everywhere
    feature_layers: int = 3  # PointTransformerConv blocks
    heads: int = 4  # attention heads of the shuffle and refine stages
    concat: bool = True  # heads concatenated (each C·r/heads or C/heads wide) or averaged (each full width)
    beta: bool = True  # TransformerConv's gated skip connection
    dropout: float = 0.0  # attention dropout of the shuffle and refine stages
    start: Literal["input", "plane"] = "input"  # where the children start (module docs)
    gate: bool = False  # a learned gate on each child's offset from its start (module docs)
    plane_k: Optional[int] = (
        None  # the plane start's points: the point and its plane_k - 1 nearest (None: all graph neighbours)
    )

    def __post_init__(self):
        if self.plane_k is not None and (isinstance(self.plane_k, bool) or not 3 <= int(self.plane_k) <= self.k + 1):
            raise ConfigError(
                f"upsampler plane_k must be an integer from 3 to k + 1 = {self.k + 1}, got {self.plane_k!r}"
            )
        for name in ("ratio", "k", "hidden", "feature_layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "feature_layers" else 1):
                raise ConfigError(f"upsampler {name} must be a positive integer, got {value!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"upsampler dropout must be in [0, 1), got {self.dropout!r}")
        if self.start not in STARTS:
            raise ConfigError(f"upsampler start must be one of {', '.join(STARTS)}, got {self.start!r}")
        if self.concat and (self.hidden % self.heads):
            raise ConfigError(
                f"upsampler hidden={self.hidden} is not divisible by heads={self.heads}; "
                "with concat=True each head gets hidden/heads channels, so pick a multiple"
            )

    @classmethod
    def preset(cls, name: str, **overrides) -> "UpsamplerConfig":
        """A named preset (``tiny``, ``small``, ``paper``), optionally with fields overridden."""
        return preset("upsampler", PRESETS, name, **overrides)


# tiny: tests and CI, seconds. small: CPU training, minutes. paper: a GPU-sized
# guess in the spirit of the published models (the papers fix no widths for lidar).
PRESETS: dict[str, UpsamplerConfig] = {
    "tiny": UpsamplerConfig(hidden=16, feature_layers=1, heads=2),
    "small": UpsamplerConfig(hidden=32, feature_layers=2, heads=4),
    "paper": UpsamplerConfig(hidden=128, feature_layers=4, heads=8, dropout=0.1),
}


class Upsampled(NamedTuple):
    points: Tensor  # [r·N, 3]
    batch: Tensor  # [r·N] cloud id per output point, sorted


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def child_graph(edge_index: Tensor, num_points: int, ratio: int) -> Tensor:
    """Edges among the ``ratio`` children of every point (module docs, step 5).

    Child ``i`` of ``p`` receives from child ``i`` of each of ``p``'s neighbours and
    from ``p``'s other children.
    """
    src, dst = edge_index
    copies = torch.arange(ratio, device=edge_index.device)
    inherited_src = (src.unsqueeze(1) * ratio + copies).reshape(-1)
    inherited_dst = (dst.unsqueeze(1) * ratio + copies).reshape(-1)
    pairs = (
        torch.cartesian_prod(copies, copies)
        if ratio > 1
        else torch.zeros(0, 2, dtype=torch.long, device=edge_index.device)
    )
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    parents = torch.arange(num_points, device=edge_index.device).unsqueeze(1) * ratio
    sibling_src = (parents + pairs[:, 0]).reshape(-1)
    sibling_dst = (parents + pairs[:, 1]).reshape(-1)
    return torch.stack([torch.cat([inherited_src, sibling_src]), torch.cat([inherited_dst, sibling_dst])])


@torch.no_grad()
def plane_start(pos: Tensor, edge_index: Tensor, mean_dist: Tensor, ratio: int) -> Tensor:
    """Children on each point's local plane (module docs): ``[N·ratio, 3]``, child ``p·r + i`` of point ``p``.

    The plane is the least-squares plane of the point and its graph neighbours
    (the sources of the edges into it); child 0 is the point projected onto it,
    children 1 .. r−1 lie around that at ``mean_dist / 2``, evenly spread in
    angle starting from the direction away from the point's nearest neighbour
    (in the plane): a direction of the point's own, so neighbours' children do
    not all shift the same way, and one that points into the gap beside it.
    """
    n = pos.shape[0]
    src, dst = edge_index
    count = torch.ones(n, dtype=pos.dtype, device=pos.device).index_add_(0, dst, torch.ones_like(pos[src, 0]))
    centroid = pos.clone().index_add_(0, dst, pos[src]) / count.unsqueeze(1)
    own, rel = pos - centroid, pos[src] - centroid[dst]
    cov = torch.einsum("ni,nj->nij", own, own).index_add_(0, dst, torch.einsum("ei,ej->eij", rel, rel))
    _, vectors = torch.linalg.eigh(cov)  # eigenvalues ascending: the normal first, the principal direction last
    normal = vectors[:, :, 0]
    projected = pos - (own * normal).sum(dim=1, keepdim=True) * normal
    if ratio == 1:
        return projected
    away = _away_from_nearest(pos, edge_index)
    away = away - (away * normal).sum(dim=1, keepdim=True) * normal
    length = away.norm(dim=1, keepdim=True)
    # A point on top of its nearest neighbour (or without any) takes the plane's principal direction.
    u = torch.where(length > 1e-6, away / length.clamp(min=1e-12), vectors[:, :, 2])
    v = torch.linalg.cross(normal, u)
    angles = 2 * torch.pi * torch.arange(ratio - 1, dtype=pos.dtype, device=pos.device) / (ratio - 1)
    ring = torch.cos(angles)[None, :, None] * u[:, None, :] + torch.sin(angles)[None, :, None] * v[:, None, :]
    children = projected[:, None, :] + 0.5 * mean_dist[:, None, None] * ring
    return torch.cat([projected[:, None, :], children], dim=1).reshape(n * ratio, 3)


def nearest_edges(pos: Tensor, edge_index: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """The edges into each point from its ``keep`` nearest sources only, and their lengths."""
    src, dst = edge_index
    dist = (pos[src] - pos[dst]).norm(dim=1)
    order = torch.argsort(dist, stable=True)
    order = order[torch.argsort(dst[order], stable=True)]  # grouped by target, nearest first
    grouped = dst[order]
    rank = torch.arange(len(order), device=pos.device) - torch.searchsorted(grouped, grouped)
    chosen = order[rank < keep]
    return edge_index[:, chosen], dist[chosen]


def _away_from_nearest(pos: Tensor, edge_index: Tensor) -> Tensor:
    """``pos − pos[nearest graph neighbour]`` per point (zero for a point without edges)."""
    src, dst = edge_index
    dist = (pos[src] - pos[dst]).norm(dim=1)
    closest = torch.full_like(pos[:, 0], float("inf")).scatter_reduce(0, dst, dist, "amin")
    nearest = torch.arange(pos.shape[0], device=pos.device)
    hit = dist == closest[dst]
    nearest[dst[hit]] = src[hit]  # a tie keeps either: both are equally near
    return pos - pos[nearest]


def _pyg_layers() -> ModuleType:
    """PyG's graph layers, imported when an upsampler is built rather than with this module:
    torch_geometric's import is slow and loads Numba (``torch_geometric.utils.ppr`` imports it
    where installed), which a process that never builds an upsampler (generate without
    upsampling, demo, serve) should not pay (:mod:`pointforge.nn.backends`)."""
    from torch_geometric import nn as pyg_nn  # noqa: PLC0415 - deferred, see above

    return pyg_nn


class _PointTransformerBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.conv = _pyg_layers().PointTransformerConv(
            channels,
            channels,
            pos_nn=_mlp([3, channels, channels]),
            attn_nn=_mlp([channels, channels, channels]),
        )
        self.act = nn.GELU()

    def forward(self, x: Tensor, pos: Tensor, edge_index: Tensor) -> Tensor:
        return x + self.act(self.conv(self.norm(x), pos, edge_index))


class NodeShuffleUpsampler(nn.Module):
    """See the module docs. ``forward(pos, batch, edge_index) -> Upsampled(points, batch)``."""

    def __init__(self, config: Optional[UpsamplerConfig] = None):
        super().__init__()
        cfg = config or UpsamplerConfig()
        self.config = cfg
        c, r, h = cfg.hidden, cfg.ratio, cfg.heads
        attention = dict(heads=h, concat=cfg.concat, beta=cfg.beta, dropout=float(cfg.dropout))
        self.embed = nn.Linear(4, c)
        self.blocks = nn.ModuleList(_PointTransformerBlock(c) for _ in range(cfg.feature_layers))
        self.shuffle_norm = nn.LayerNorm(c)
        # Per-head width that makes the attention's output exactly r·C wide (C % heads == 0 under concat).
        self.shuffle = _pyg_layers().TransformerConv(c, r * c // h if cfg.concat else r * c, **attention)
        self.child_norm = nn.LayerNorm(c)
        self.coarse = nn.Linear(c, 3)
        self.relpos = _mlp([4, c, c])
        self.refine_norm = nn.LayerNorm(c)
        self.refine = _pyg_layers().TransformerConv(c, c // h if cfg.concat else c, edge_dim=c, **attention)
        self.decode = nn.Sequential(nn.LayerNorm(c), _mlp([c, c, 3]))
        self.gate = nn.Linear(c, 1) if cfg.gate else None
        # Near-zero heads: the output starts at the children's start, so early training only learns offsets.
        for head in (self.coarse, self.decode[-1][-1]):  # type: ignore[index]  # decode[-1] is an _mlp Sequential
            nn.init.normal_(head.weight, std=1e-3)
            nn.init.zeros_(head.bias)

    def forward(self, pos: Tensor, batch: Optional[Tensor] = None, edge_index: Optional[Tensor] = None) -> Upsampled:
        if not isinstance(pos, Tensor) or pos.dim() != 2 or pos.shape[1] != 3 or not pos.is_floating_point():
            desc = f"{tuple(pos.shape)} {pos.dtype}" if isinstance(pos, Tensor) else type(pos).__name__
            raise DataError(f"upsampler input must be a floating-point [N, 3] tensor, got {desc}")
        n, r = pos.shape[0], self.config.ratio
        batch = check_batch(batch, n, "batch").to(pos.device)
        if edge_index is None:
            edge_index = knn_graph(pos, self.config.k, batch)
        elif edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise DataError(f"edge_index must be [2, E], got {tuple(edge_index.shape)}")
        edge_index = edge_index.to(pos.device)
        src, dst = edge_index

        # Translation-invariant input: offset from the neighbours' centroid, mean neighbour distance.
        degree = torch.zeros(n, dtype=pos.dtype, device=pos.device).index_add_(
            0, dst, torch.ones_like(dst, dtype=pos.dtype)
        )
        rel = pos[src] - pos[dst]
        mean_rel = torch.zeros_like(pos).index_add_(0, dst, rel) / degree.clamp(min=1).unsqueeze(1)
        mean_dist = torch.zeros(n, dtype=pos.dtype, device=pos.device).index_add_(0, dst, rel.norm(dim=1))
        mean_dist = mean_dist / degree.clamp(min=1)
        x = self.embed(torch.cat([-mean_rel, mean_dist.unsqueeze(1)], dim=1))
        for block in self.blocks:
            x = block(x, pos, edge_index)

        children = self.shuffle(self.shuffle_norm(x), edge_index).reshape(n * r, self.config.hidden)
        children = self.child_norm(children)
        if self.config.start == "plane" and self.config.plane_k is not None:
            near, near_dist = nearest_edges(pos, edge_index, self.config.plane_k - 1)
            count = torch.zeros(n, dtype=pos.dtype, device=pos.device).index_add_(
                0, near[1], torch.ones_like(near_dist)
            )
            near_mean = torch.zeros(n, dtype=pos.dtype, device=pos.device).index_add_(0, near[1], near_dist)
            base = plane_start(pos, near, near_mean / count.clamp(min=1), r)
        elif self.config.start == "plane":
            base = plane_start(pos, edge_index, mean_dist, r)
        else:
            base = pos.repeat_interleave(r, dim=0)
        coarse = self.coarse(children)
        child_edges = child_graph(edge_index, n, r)
        c_src, c_dst = child_edges
        delta = (base + coarse)[c_src] - (base + coarse)[c_dst]
        edge_attr = self.relpos(torch.cat([delta, delta.norm(dim=1, keepdim=True)], dim=1))
        children = children + self.refine(self.refine_norm(children), child_edges, edge_attr=edge_attr)
        offset = coarse + self.decode(children)
        if self.gate is not None:
            offset = torch.sigmoid(self.gate(children)) * offset
        return Upsampled(points=base + offset, batch=batch.repeat_interleave(r))


# A training step's bytes per counted element (see training_step_bytes), fitted by
# bench/pvcnn_memory.py to measured peaks (docs/experiments/benchmarks.md, "Training memory").
_BYTES_PER_EDGE_ELEMENT = 6.0
_BYTES_PER_NODE_ELEMENT = 0.0  # fitted to 0: the per-point layers are freed before the peak
# Neighbours per point of the symmetrised k-NN graph (between k and 2k): bench/pvcnn_memory.py
# measures 1.16 k on surface-like clouds; 1.5 k errs high (lidar rows may come nearer 2 k).
_EDGES_PER_K = 1.5


def training_elements(config: UpsamplerConfig, edges_per_point: float | None = None) -> tuple[float, float]:
    """Per sparse point, the ``(edge, node)`` elements a training step keeps for backward.

    ``edge``: channels × edges (the feature blocks' position and attention MLPs,
    the shuffle's keys and values, the refinement's edge features on the child
    graph); ``node``: channels × points of every per-point layer.
    ``edges_per_point``: of the symmetrised k-NN graph (None: the assumed 1.5 k).
    """
    c, r, layers = config.hidden, config.ratio, config.feature_layers
    edges = _EDGES_PER_K * config.k if edges_per_point is None else edges_per_point
    child_edges = r * edges + r * (r - 1)
    return c * (edges * (6 * layers + 3 * r) + child_edges * 8), c * (4 * layers + 8 * r)


def training_step_bytes(config: UpsamplerConfig, points: int, *, parameters: int) -> int:
    """Bytes a float32 training step on ``points`` sparse points needs beyond the weights:
    the activations (:func:`training_elements`) plus gradients and Adam's two moments."""
    edge, node = training_elements(config)
    per_point = _BYTES_PER_EDGE_ELEMENT * edge + _BYTES_PER_NODE_ELEMENT * node
    return int(points * per_point + 3 * 4 * parameters)


def build_upsampler(config: UpsamplerConfig | str | None = None, **overrides) -> NodeShuffleUpsampler:
    """A model from a config, a preset name (with overrides), or the defaults."""
    if isinstance(config, str):
        config = UpsamplerConfig.preset(config, **overrides)
    elif overrides:
        config = dataclasses.replace(config or UpsamplerConfig(), **overrides)
    return NodeShuffleUpsampler(config)

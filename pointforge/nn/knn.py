"""k-nearest-neighbour search over disjoint batches of point clouds.

PyG's ``knn``/``knn_graph`` need pyg-lib or torch-cluster; these do not. Two
backends, tested equal to each other and to brute force:

* ``"kdtree"``: :class:`scipy.spatial.cKDTree` per cloud, on the CPU, with
  ``workers`` threads. Fast and memory-light for any cloud size.
* ``"torch"``: exact squared distances in chunks of queries × references with
  a running top-k; device-agnostic pure PyTorch (CUDA, MPS, CPU). Memory is
  bounded by ``max_pairs`` distance entries per chunk, whatever the cloud size.

``"auto"`` picks the KD-tree for CPU tensors and the torch path elsewhere.

Clouds are laid out as PyG does it: points of all clouds concatenated, with a
sorted ``batch`` vector giving each point's cloud. A query only ever finds
references of its own cloud.

Conventions shared by both backends (what the tests pin):

* Squared distances are computed the same way in both, as
  ``((query - ref[index]) ** 2).sum(-1)`` in the input dtype, so equal indices
  give bit-equal distances.
* Each row is ordered by (squared distance, index) ascending.
* Where several candidates tie at the k-th distance, which of them is kept is
  backend-defined; the returned distances are the same either way.
* A cloud with fewer than ``k`` candidates pads its rows with index ``-1`` and
  distance ``inf``.
* ``exclude_self`` drops the query's own index (query and reference must be the
  same set); duplicates of a point at distance 0 remain neighbours.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
from scipy.spatial import cKDTree
from torch import Tensor

from pointforge.errors import ConfigError, DataError

__all__ = ["KNNResult", "BACKENDS", "knn", "knn_graph", "batch_ptr", "check_batch"]

BACKENDS = ("auto", "kdtree", "torch")
# 4M entries: ~64 MB of float32 differences and distances per chunk.
DEFAULT_MAX_PAIRS = 1 << 22
_PARALLEL_QUERIES = 16384


class KNNResult(NamedTuple):
    """``dist2[i, j]``/``index[i, j]``: the j-th neighbour of query i (padded with inf / -1)."""

    dist2: Tensor
    index: Tensor  # type: ignore[assignment]  # shadows tuple.index; the field name is public API


def _check_points(x: Tensor, what: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] < 1:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise DataError(f"{what} must be an [N, D] tensor of coordinates, got {shape}")
    if not x.is_floating_point():
        raise DataError(f"{what} must hold floating-point coordinates, got dtype {x.dtype}")


def check_batch(batch: Optional[Tensor], n: int, what: str) -> Tensor:
    """``batch`` as a sorted int64 vector of length ``n`` (all zeros when None)."""
    if batch is None:
        return torch.zeros(n, dtype=torch.long)
    if not isinstance(batch, Tensor) or batch.dim() != 1 or batch.numel() != n:
        shape = tuple(batch.shape) if isinstance(batch, Tensor) else type(batch).__name__
        raise DataError(f"{what} must be a vector of {n} cloud ids, got {shape}")
    if batch.dtype.is_floating_point or batch.dtype == torch.bool:
        raise DataError(f"{what} must hold integer cloud ids, got dtype {batch.dtype}")
    batch = batch.long()
    if n and (bool((batch[1:] < batch[:-1]).any()) or int(batch[0]) < 0):
        raise DataError(f"{what} must be sorted and non-negative (clouds stored one after another)")
    return batch


def batch_ptr(batch: Tensor, num_clouds: Optional[int] = None) -> Tensor:
    """CSR offsets ``[B + 1]`` of a sorted batch vector (on the CPU)."""
    batch = batch.detach().cpu()
    if num_clouds is None:
        num_clouds = int(batch[-1]) + 1 if batch.numel() else 0
    counts = (
        torch.bincount(batch, minlength=num_clouds)[:num_clouds]
        if batch.numel()
        else torch.zeros(num_clouds, dtype=torch.long)
    )
    ptr = torch.zeros(num_clouds + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=ptr[1:])
    return ptr


def _canonical(dist2: Tensor, index: Tensor) -> KNNResult:
    # Sorting by index first and then stably by distance gives (distance, index) order.
    missing = index < 0
    index_key = torch.where(missing, torch.iinfo(torch.long).max, index)
    order = torch.argsort(index_key, dim=1, stable=True)
    dist2, index = dist2.gather(1, order), index.gather(1, order)
    order = torch.argsort(dist2, dim=1, stable=True)
    return KNNResult(dist2.gather(1, order), index.gather(1, order))


def _exact_dist2(ref: Tensor, query: Tensor, index: Tensor) -> Tensor:
    safe = index.clamp(min=0)
    d = ((query.unsqueeze(1) - ref[safe]) ** 2).sum(-1)
    return d.masked_fill(index < 0, float("inf"))


def _kdtree_cloud(ref: np.ndarray, query: np.ndarray, k: int, exclude_self: bool, workers: Optional[int]) -> np.ndarray:
    """Local neighbour indices [nq, k] (-1 padded) of one cloud."""
    nq, nr = query.shape[0], ref.shape[0]
    out = np.full((nq, k), -1, dtype=np.int64)
    available = nr - 1 if exclude_self else nr
    k_eff = min(k, available)
    if nq == 0 or k_eff <= 0:
        return out
    ask = min(k_eff + 1, nr) if exclude_self else k_eff
    if workers is None:
        # Thread start-up costs more than it saves on small clouds.
        workers = -1 if nq >= _PARALLEL_QUERIES else 1
    _, idx = cKDTree(ref).query(query, k=ask, workers=workers)
    idx = np.asarray(idx, dtype=np.int64).reshape(nq, ask)
    if exclude_self:
        own = idx == np.arange(nq)[:, None]
        # The own index may be crowded out by duplicates at distance 0; then drop the last instead.
        no_own = ~own.any(axis=1)
        own[no_own, ask - 1] = True
        idx = idx[~own].reshape(nq, ask - 1)[:, :k_eff]
    out[:, :k_eff] = idx[:, :k_eff]
    return out


def _torch_cloud(ref: Tensor, query: Tensor, k: int, exclude_self: bool, max_pairs: int) -> Tensor:
    """Local neighbour indices [nq, k] (-1 padded) of one cloud, by chunked exact distances."""
    nq, nr = query.shape[0], ref.shape[0]
    device = query.device
    out = torch.full((nq, k), -1, dtype=torch.long, device=device)
    available = nr - 1 if exclude_self else nr
    k_eff = min(k, available)
    if nq == 0 or k_eff <= 0:
        return out
    q_chunk = max(1, min(nq, max_pairs // max(1, min(nr, max_pairs)), 4096))
    r_chunk = max(k_eff, min(nr, max_pairs // q_chunk))
    inf = torch.tensor(float("inf"), dtype=query.dtype, device=device)
    for q0 in range(0, nq, q_chunk):
        q = query[q0 : q0 + q_chunk]
        best_d = torch.full((q.shape[0], k_eff), float("inf"), dtype=query.dtype, device=device)
        best_i = torch.full((q.shape[0], k_eff), -1, dtype=torch.long, device=device)
        for r0 in range(0, nr, r_chunk):
            r = ref[r0 : r0 + r_chunk]
            d = ((q.unsqueeze(1) - r.unsqueeze(0)) ** 2).sum(-1)
            cols = torch.arange(r0, r0 + r.shape[0], device=device)
            if exclude_self:
                rows = torch.arange(q0, q0 + q.shape[0], device=device)
                d = torch.where(rows[:, None] == cols[None, :], inf, d)
            cand_d = torch.cat([best_d, d], dim=1)
            cand_i = torch.cat([best_i, cols.expand(q.shape[0], -1)], dim=1)
            best_d, pos = torch.topk(cand_d, k_eff, dim=1, largest=False, sorted=False)
            best_i = cand_i.gather(1, pos)
        out[q0 : q0 + q.shape[0], :k_eff] = best_i
    return out


@torch.no_grad()
def knn(
    ref: Tensor,
    query: Tensor,
    k: int,
    batch_ref: Optional[Tensor] = None,
    batch_query: Optional[Tensor] = None,
    *,
    exclude_self: bool = False,
    backend: str = "auto",
    workers: Optional[int] = None,
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> KNNResult:
    """The ``k`` nearest references of every query point, within its own cloud.

    ``ref`` ``[Nr, D]`` and ``query`` ``[Nq, D]`` with sorted batch vectors
    (``None``: one cloud). ``workers``: KD-tree query threads (``None``: all
    cores for clouds of 16k+ queries, one below). Returns global indices into ``ref`` and squared
    distances, both ``[Nq, k]``, ordered and padded as the module docs say.
    No gradients flow through the search; gather the points yourself for that.
    """
    _check_points(ref, "reference points")
    _check_points(query, "query points")
    if ref.shape[1] != query.shape[1]:
        raise DataError(f"reference and query points differ in dimension ({ref.shape[1]} vs {query.shape[1]})")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k must be a positive integer, got {k!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kNN backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if max_pairs < 1:
        raise ConfigError(f"max_pairs must be at least 1, got {max_pairs}")
    k = int(k)
    if exclude_self and (ref.shape[0] != query.shape[0]):
        raise DataError("exclude_self needs the query set to be the reference set")
    batch_ref = check_batch(batch_ref, ref.shape[0], "batch_ref")
    batch_query = check_batch(batch_query, query.shape[0], "batch_query")
    if exclude_self and not torch.equal(batch_ref.cpu(), batch_query.cpu()):
        raise DataError("exclude_self needs the query set to be the reference set")
    num_clouds = max(
        int(batch_ref[-1]) + 1 if batch_ref.numel() else 0,
        int(batch_query[-1]) + 1 if batch_query.numel() else 0,
    )
    ptr_r = batch_ptr(batch_ref, num_clouds).tolist()
    ptr_q = batch_ptr(batch_query, num_clouds).tolist()
    if backend == "auto":
        backend = "kdtree" if query.device.type == "cpu" and ref.device.type == "cpu" else "torch"

    index = torch.full((query.shape[0], k), -1, dtype=torch.long, device=query.device)
    if backend == "kdtree":
        ref_np = ref.detach().cpu().numpy()
        query_np = query.detach().cpu().numpy()
        out = np.full((query.shape[0], k), -1, dtype=np.int64)
        for b in range(num_clouds):
            r0, r1, q0, q1 = ptr_r[b], ptr_r[b + 1], ptr_q[b], ptr_q[b + 1]
            local = _kdtree_cloud(ref_np[r0:r1], query_np[q0:q1], k, exclude_self, workers)
            out[q0:q1] = np.where(local >= 0, local + r0, -1)
        index = torch.from_numpy(out).to(query.device)
    else:
        ref_d = ref.detach().to(query.device)
        query_d = query.detach()
        for b in range(num_clouds):
            r0, r1, q0, q1 = ptr_r[b], ptr_r[b + 1], ptr_q[b], ptr_q[b + 1]
            local_t = _torch_cloud(ref_d[r0:r1], query_d[q0:q1], k, exclude_self, max_pairs)
            index[q0:q1] = torch.where(local_t >= 0, local_t + r0, local_t)
    dist2 = _exact_dist2(ref.detach().to(query.device), query.detach(), index)
    return _canonical(dist2, index)


@torch.no_grad()
def knn_graph(
    pos: Tensor,
    k: int = 10,
    batch: Optional[Tensor] = None,
    *,
    symmetric: bool = True,
    backend: str = "auto",
    workers: Optional[int] = None,
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> Tensor:
    """The k-NN graph of ``pos`` as ``edge_index [2, E]`` (row 0 source, row 1 target).

    Each point receives edges from its ``k`` nearest other points of the same
    cloud (fewer when the cloud is smaller). ``symmetric`` adds the reverse of
    every edge, making the graph undirected: a point then has between ``k`` and
    ``2k`` neighbours. No self-loops; no duplicate edges; edges sorted by
    (target, source).
    """
    n = pos.shape[0] if isinstance(pos, Tensor) else 0
    result = knn(pos, pos, k, batch, batch, exclude_self=True, backend=backend, workers=workers, max_pairs=max_pairs)
    target = torch.arange(n, device=pos.device).unsqueeze(1).expand(-1, k)
    keep = result.index >= 0
    source, target = result.index[keep], target[keep]
    if symmetric:
        source, target = torch.cat([source, target]), torch.cat([target, source])
    key = torch.unique(target * max(n, 1) + source)
    return torch.stack([key % max(n, 1), key // max(n, 1)])

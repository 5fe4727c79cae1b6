"""The upsampler's Dataset: normalised sparse/dense pairs with the sparse cloud's kNN graph.

The k-NN graph of each sparse cloud is computed once (``pointforge.nn.knn``,
k nearest, symmetrised) and cached in memory for the life of the dataset
object (per DataLoader worker), and with ``graph_cache="disk"`` also beside
the data as ``<sparse file>.knn<k>.npy``, reused while it is newer than the
cloud it was computed from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from pointforge.data.pairs.manifest import PairEntry, read_manifest
from pointforge.data.pairs.normalization import NORMALIZATIONS, PairNormalization, pair_normalization
from pointforge.data.pointio import atomic_write, count_points, read_points
from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import knn_graph

GRAPH_CACHES = ("memory", "disk")


@dataclass
class CloudPair:
    """One normalised pair, as a dataset returns it and :func:`collate_pairs` takes it."""

    sparse: Tensor  # float32 [N, 3]
    dense: Tensor  # float32 [M, 3]
    edge_index: Tensor  # int64 [2, E], the sparse cloud's symmetric kNN graph, local indices
    center: np.ndarray  # float64 [3]
    scale: float
    pair_id: str
    index: int

    @property
    def normalization(self) -> PairNormalization:
        return PairNormalization(center=self.center, scale=self.scale)


def graph_cache_path(sparse_path: str | os.PathLike, k: int) -> Path:
    """Where the on-disk graph cache of ``sparse_path`` lives: beside it, keyed by file name and k."""
    p = Path(sparse_path)
    return p.with_name(f"{p.name}.knn{k}.npy")


def _valid_cached_graph(edges: np.ndarray, n: int) -> bool:
    return (
        edges.ndim == 2 and edges.shape[0] == 2 and np.issubdtype(edges.dtype, np.integer)
        and (edges.size == 0 or (int(edges.min()) >= 0 and int(edges.max()) < n))
    )  # fmt: skip


class UpsamplingPairs(Dataset):
    """Pairs from a manifest (or a list of :class:`PairEntry`), normalised, with the sparse kNN graph.

    ``sparse_sizes`` / ``dense_sizes`` hold every pair's point counts, read from
    file headers at construction, for batch planning before any cloud is loaded.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[PairEntry],
        *,
        k: int = 10,
        normalization: str = "spacing",
        graph_cache: str = "memory",
        knn_workers: int = 1,
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {normalization!r}; choose one of {', '.join(NORMALIZATIONS)}")
        if graph_cache not in GRAPH_CACHES:
            raise ConfigError(f"unknown graph_cache {graph_cache!r}; choose one of {', '.join(GRAPH_CACHES)}")
        self.entries = list(source) if isinstance(source, (list, tuple)) else read_manifest(source)  # type: ignore[arg-type]  # otherwise a path
        if not self.entries:
            raise DataError("no pairs given; list at least one sparse/dense pair")
        self.k = k
        self.normalization = normalization
        self.graph_cache = graph_cache
        self.knn_workers = knn_workers
        self.sparse_sizes = np.array([count_points(e.sparse) for e in self.entries], dtype=np.int64)
        self.dense_sizes = np.array([count_points(e.dense) for e in self.entries], dtype=np.int64)
        self._graphs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def graph(self, index: int, sparse_xyz: Optional[np.ndarray] = None) -> np.ndarray:
        """The sparse cloud's symmetric kNN graph ``[2, E]`` (int32 or int64), computed once."""
        cached = self._graphs.get(index)
        if cached is not None:
            return cached
        entry = self.entries[index]
        if sparse_xyz is None:
            sparse_xyz = read_points(entry.sparse).xyz
        n = len(sparse_xyz)
        edges = None
        disk = graph_cache_path(entry.sparse, self.k) if self.graph_cache == "disk" else None
        if disk is not None and disk.is_file() and disk.stat().st_mtime_ns >= entry.sparse.stat().st_mtime_ns:
            try:
                loaded = np.load(disk, allow_pickle=False)
                edges = loaded if _valid_cached_graph(loaded, n) else None
            except (OSError, ValueError):
                edges = None  # a damaged cache is recomputed, never trusted
        if edges is None:
            centred = torch.from_numpy(sparse_xyz - sparse_xyz.min(axis=0))
            edges = knn_graph(centred, self.k, workers=self.knn_workers).numpy()
            edges = edges.astype(np.int32) if n < 2**31 else edges
            if disk is not None:
                try:
                    _save_graph(disk, edges)
                except OSError as err:
                    raise DataError(
                        f"cannot write the graph cache {disk} ({err.strerror or err}); "
                        "make the data folder writable or use graph_cache='memory'"
                    ) from None
        self._graphs[index] = edges
        return edges

    def __getitem__(self, index: int) -> CloudPair:
        if not 0 <= index < len(self.entries):
            raise IndexError(f"pair index {index} out of range for {len(self.entries)} pairs")
        entry = self.entries[index]
        sparse = read_points(entry.sparse).xyz
        dense = read_points(entry.dense).xyz
        for cloud, path in ((sparse, entry.sparse), (dense, entry.dense)):
            if len(cloud) == 0:
                raise DataError(f"{path}: point cloud is empty; remove pair {entry.pair_id!r} from the manifest")
        edges = self.graph(index, sparse)
        norm = pair_normalization(sparse, self.normalization, edges)
        return CloudPair(
            sparse=torch.from_numpy(norm.apply(sparse)),
            dense=torch.from_numpy(norm.apply(dense)),
            edge_index=torch.from_numpy(edges.astype(np.int64)),
            center=norm.center,
            scale=norm.scale,
            pair_id=entry.pair_id,
            index=index,
        )


def _save_graph(path: Path, edges: np.ndarray) -> None:
    def write(tmp):
        with open(tmp, "wb") as fh:
            np.save(fh, edges)

    atomic_write(path, write)

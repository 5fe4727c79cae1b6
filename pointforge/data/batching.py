"""Variable-size batches: a disjoint-graph collate and a distributed point-budget batch sampler.

Collate
-------
:func:`collate_pairs` concatenates the clouds of a batch PyG-style: one point
tensor per side, a sorted ``batch`` vector (cloud id per point), CSR offsets
``ptr`` and the sparse kNN graphs shifted into the concatenated index space,
so no edge joins two clouds. The normalisation of every pair rides along (on
the CPU, float64) to map predictions back to the source coordinates.

Point-budget batch sampler
--------------------------
:class:`PointBudgetBatchSampler` groups clouds so that each batch holds at
most ``max_points`` points (and at most ``max_clouds`` clouds) on each device.
Per epoch, from ``(seed, epoch)`` alone, identically on every rank:

1. Shuffle all sample indices.
2. Pack them in that order, first-fit into the most recent ``lookahead`` open
   batches (a batch closes when it is full or falls out of the window). A
   sample larger than the budget gets a batch of its own: refusing it would
   make one big tile stop a whole run, and the budget is a throughput knob,
   not a hard memory guarantee. ``oversize`` lists such samples.
3. Equalise: the number of batches must be a multiple of
   ``world_size × accumulation`` so every rank makes the same number of
   optimizer steps (no rank left waiting in an all-reduce). Batches are *split*
   (the heaviest batch holding two or more clouds, halved by points) until it
   is. Only when no batch can be split any more (every batch is a single
   cloud, e.g. fewer samples than ranks) are batches *repeated*: the smallest
   single-cloud batches, at most ``world_size × accumulation - 1`` of them;
   ``repeated`` says how many this epoch. So every sample is used exactly once
   per epoch, apart from those few repeats in that corner case.
4. Deal out: batches sorted by points, consecutive groups of ``world_size``
   form one step (so the ranks of a step carry similar loads and wait little
   for each other), group ``g`` gives batch ``r`` to rank ``r``; the order of the
   steps is then shuffled.

``len(sampler)`` is the same on every rank. ``set_epoch`` changes the shuffle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from pointforge.data.pairs.dataset import CloudPair
from pointforge.data.pairs.normalization import PairNormalization
from pointforge.errors import ConfigError, DataError

__all__ = ["PairBatch", "collate_pairs", "PointBudgetBatchSampler"]


# --------------------------------------------------------------------------- collate


@dataclass
class PairBatch:
    """A batch of pairs as disjoint graphs (see module docs).

    ``center``/``scale`` stay on the CPU in float64 when the batch moves to a
    device: they are only needed to map results back, and some accelerators
    have no float64.
    """

    sparse: Tensor  # float32 [N, 3]
    sparse_batch: Tensor  # int64 [N]
    sparse_ptr: Tensor  # int64 [B + 1]
    dense: Tensor  # float32 [M, 3]
    dense_batch: Tensor  # int64 [M]
    dense_ptr: Tensor  # int64 [B + 1]
    edge_index: Tensor  # int64 [2, E], into ``sparse``
    center: Tensor  # float64 [B, 3], CPU
    scale: Tensor  # float64 [B], CPU
    pair_ids: list[str] = field(default_factory=list)
    indices: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # dataset indices [B]

    @property
    def num_clouds(self) -> int:
        return int(self.sparse_ptr.numel() - 1)

    @property
    def num_points(self) -> int:
        """Sparse (input) points in the batch: what the point budget counts."""
        return int(self.sparse.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PairBatch":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return PairBatch(
            sparse=move(self.sparse),
            sparse_batch=move(self.sparse_batch),
            sparse_ptr=self.sparse_ptr,
            dense=move(self.dense),
            dense_batch=move(self.dense_batch),
            dense_ptr=self.dense_ptr,
            edge_index=move(self.edge_index),
            center=self.center,
            scale=self.scale,
            pair_ids=list(self.pair_ids),
            indices=self.indices,
        )

    def pin_memory(self) -> "PairBatch":
        # Called by DataLoader(pin_memory=True) in its pinning thread.
        def pin(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory()

        return PairBatch(
            sparse=pin(self.sparse),
            sparse_batch=pin(self.sparse_batch),
            sparse_ptr=self.sparse_ptr,
            dense=pin(self.dense),
            dense_batch=pin(self.dense_batch),
            dense_ptr=self.dense_ptr,
            edge_index=pin(self.edge_index),
            center=self.center,
            scale=self.scale,
            pair_ids=list(self.pair_ids),
            indices=self.indices,
        )

    def normalization(self, cloud: int) -> PairNormalization:
        return PairNormalization(center=self.center[cloud].numpy(), scale=float(self.scale[cloud]))

    def split(self, points: Tensor, batch: Tensor) -> list[Tensor]:
        """Per-cloud pieces of any ``[P, D]`` tensor laid out by a sorted ``batch`` vector."""
        counts = torch.bincount(batch.detach().cpu(), minlength=self.num_clouds)[: self.num_clouds]
        return list(torch.split(points, counts.tolist()))

    def denormalize(self, points: Tensor, batch: Tensor) -> list[np.ndarray]:
        """Per-cloud float64 arrays of ``points`` mapped back to each pair's source coordinates."""
        return [self.normalization(b).inverse(piece) for b, piece in enumerate(self.split(points, batch))]


def _ptr(counts: Sequence[int]) -> Tensor:
    ptr = torch.zeros(len(counts) + 1, dtype=torch.long)
    ptr[1:] = torch.cumsum(torch.as_tensor(counts, dtype=torch.long), 0)
    return ptr


def collate_pairs(items: Sequence[CloudPair]) -> PairBatch:
    """Merge :class:`CloudPair` items into one :class:`PairBatch` of disjoint graphs."""
    if not items:
        raise DataError("cannot collate an empty batch; the batch sampler produced no samples")
    n_sparse = [int(it.sparse.shape[0]) for it in items]
    n_dense = [int(it.dense.shape[0]) for it in items]
    sparse_ptr, dense_ptr = _ptr(n_sparse), _ptr(n_dense)
    clouds = torch.arange(len(items))
    edges = [it.edge_index + sparse_ptr[i] for i, it in enumerate(items)]
    return PairBatch(
        sparse=torch.cat([it.sparse for it in items]),
        sparse_batch=torch.repeat_interleave(clouds, torch.as_tensor(n_sparse)),
        sparse_ptr=sparse_ptr,
        dense=torch.cat([it.dense for it in items]),
        dense_batch=torch.repeat_interleave(clouds, torch.as_tensor(n_dense)),
        dense_ptr=dense_ptr,
        edge_index=torch.cat(edges, dim=1) if edges else torch.zeros(2, 0, dtype=torch.long),
        center=torch.from_numpy(np.stack([np.asarray(it.center, dtype=np.float64) for it in items])),
        scale=torch.tensor([float(it.scale) for it in items], dtype=torch.float64),
        pair_ids=[it.pair_id for it in items],
        indices=torch.tensor([int(it.index) for it in items], dtype=torch.long),
    )


# --------------------------------------------------------------------------- sampler


def _check_count(value, what: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")
    return int(value)


class PointBudgetBatchSampler:
    """Batches of sample indices under a per-device point budget, equal in number on every rank.

    ``sizes[i]`` is sample ``i``'s cost in points (for the upsampler: its sparse
    cloud's size, ``UpsamplingPairs.sparse_sizes``). See the module docs for the
    per-epoch scheme. Use as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_pairs)``
    and call ``set_epoch`` before each epoch.
    """

    def __init__(
        self,
        sizes: Sequence[int] | np.ndarray,
        max_points: int,
        *,
        max_clouds: Optional[int] = None,
        world_size: int = 1,
        rank: int = 0,
        accumulation: int = 1,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        lookahead: int = 16,
    ):
        sizes = np.asarray(sizes)
        if sizes.ndim != 1 or sizes.size == 0 or not np.issubdtype(sizes.dtype, np.integer):
            raise DataError(
                f"sizes must be a non-empty vector of integer point counts, got shape {sizes.shape} {sizes.dtype}"
            )
        if (sizes < 1).any():
            bad = int(np.flatnonzero(sizes < 1)[0])
            raise DataError(f"sample {bad} has {int(sizes[bad])} points; remove empty clouds from the dataset")
        self.sizes = sizes.astype(np.int64)
        self.max_points = _check_count(max_points, "max_points")
        self.max_clouds = _check_count(max_clouds, "max_clouds") if max_clouds is not None else None
        self.world_size = _check_count(world_size, "world_size")
        self.rank = _check_count(rank, "rank", 0)
        if self.rank >= self.world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        self.accumulation = _check_count(accumulation, "accumulation")
        self.lookahead = _check_count(lookahead, "lookahead")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = int(epoch)
        self._plan: Optional[tuple[int, list[list[list[int]]]]] = None
        self.repeated = 0
        self.oversize = np.flatnonzero(self.sizes > self.max_points)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.plan()[self.rank])

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.plan()[self.rank]])

    def plan(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: ``plan()[rank][step]`` is a list of indices."""
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, self._build(self.epoch))
        return self._plan[1]

    # -- the scheme, step by step (module docs)

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng(
            np.random.SeedSequence([self.seed & 0xFFFFFFFF, self.seed >> 32, epoch & 0xFFFFFFFF, 0xB0D6])
        )

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        closed: list[list[int]] = []
        open_: list[list[int]] = []
        loads: list[int] = []
        cap = self.max_clouds or len(order)
        for i in order.tolist():
            size = int(self.sizes[i])
            if size > self.max_points:
                closed.append([i])
                continue
            for slot, batch in enumerate(open_):
                if loads[slot] + size <= self.max_points and len(batch) < cap:
                    batch.append(i)
                    loads[slot] += size
                    break
            else:
                open_.append([i])
                loads.append(size)
                if len(open_) > self.lookahead:
                    closed.append(open_.pop(0))
                    loads.pop(0)
        return closed + open_

    def _load(self, batch: list[int]) -> int:
        return int(self.sizes[batch].sum())

    def _split(self, batch: list[int]) -> tuple[list[int], list[int]]:
        # Largest first into the lighter half: two halves of nearly equal points.
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for i in sorted(batch, key=lambda j: (-int(self.sizes[j]), j)):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(i)
            loads[side] += int(self.sizes[i])
        return halves

    def _build(self, epoch: int) -> list[list[list[int]]]:
        rng = self._rng(epoch)
        n = len(self.sizes)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        batches = self._pack(order)
        multiple = self.world_size * self.accumulation
        self.repeated = 0
        while len(batches) % multiple:
            splittable = [b for b in range(len(batches)) if len(batches[b]) > 1]
            if not splittable:
                break
            heaviest = max(splittable, key=lambda b: (self._load(batches[b]), -b))
            first, second = self._split(batches[heaviest])
            batches[heaviest] = first
            batches.append(second)
        if len(batches) % multiple:
            missing = multiple - len(batches) % multiple
            smallest = sorted(range(len(batches)), key=lambda b: (self._load(batches[b]), b))
            batches.extend([list(batches[b]) for b in (smallest * multiple)[:missing]])
            self.repeated = missing
        # Similar loads share a step; then the steps are put in random order.
        ranked = sorted(range(len(batches)), key=lambda b: (-self._load(batches[b]), b))
        steps = [ranked[s : s + self.world_size] for s in range(0, len(ranked), self.world_size)]
        step_order = rng.permutation(len(steps)) if self.shuffle else np.arange(len(steps))
        return [[batches[steps[s][r]] for s in step_order.tolist()] for r in range(self.world_size)]

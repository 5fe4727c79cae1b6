"""A cell grid over reference points: the candidates near each query, for ball query and 3-NN.

The grid only changes *which* pairs are evaluated, never the arithmetic: distances of
the candidates are formed exactly as the dense paths form them.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import Tensor

from pointforge.nn.pvops.common import PAIR_BUDGET, squared_distance

__all__ = ["CellGrid", "block_squared_distance", "flat_components"]


class CellGrid:
    """Reference points bucketed into cubic cells, to list the candidates near each query.

    A query's candidates are the reference points in the 3x3x3 block of cells around the
    query's cell, so every reference point closer than ``cell`` to the query is among
    them. Cells are computed in float64 from the coordinates, so rounding cannot move a
    point by more than a hair across the boundary it lies on. Within a cell, references
    keep their index order.
    """

    # A dense cell table (O(1) lookups) is used when it is at most this many entries and
    # at most _DENSE_PER_KEY entries per reference point and looked-up key; otherwise the
    # cells are found by binary search over the sorted cell keys (the same starts and
    # counts). Filling and summing a table far larger than the points (a 0.1 radius over
    # PCDiff's normalised clouds: ~3M cells for 7k points) cost more than the search.
    _DENSE_TABLE = 1 << 22
    _DENSE_PER_KEY = 4

    def __init__(self, refs: Tensor, queries: Tensor, cell: float):
        self.cell = float(cell)
        self.batch, _, self.num_refs = refs.shape
        self.num_queries = queries.shape[2]
        device = refs.device
        refs64 = refs.detach().double()
        qry64 = queries.detach().double()
        lo = torch.minimum(refs64.amin(2), qry64.amin(2))  # [B, 3]
        hi = torch.maximum(refs64.amax(2), qry64.amax(2))
        spans = ((hi - lo).amax(0) / self.cell).tolist()
        # +1 offset and +2 margin: the 3x3x3 block of any occupied cell lies in the grid.
        dims = [int(math.floor(s)) + 3 if math.isfinite(s) else 0 for s in spans]
        self.usable = all(d > 0 for d in dims) and self.batch * dims[0] * dims[1] * dims[2] < 2**62
        if not self.usable:
            return
        gx, gy, gz = dims
        bidx = torch.arange(self.batch, device=device).view(-1, 1)

        def keys(points64: Tensor) -> Tensor:
            c = torch.floor((points64 - lo.unsqueeze(2)) / self.cell).long() + 1  # [B, 3, K]
            return (((bidx * gx + c[:, 0]) * gy + c[:, 1]) * gz + c[:, 2]).reshape(-1)

        sorted_keys, self.order = torch.sort(keys(refs64), stable=True)
        # The 3 cells of a z-column are consecutive keys: 9 key ranges cover the block.
        qcell = keys(qry64)
        column = torch.tensor([dx * gy * gz + dy * gz for dx in (-1, 0, 1) for dy in (-1, 0, 1)], device=device)
        first_key = qcell.unsqueeze(1) + column - 1  # [B*M, 9]
        last_key = first_key + 2
        table = self.batch * gx * gy * gz
        lookups = sorted_keys.numel() + first_key.numel()
        if table <= min(self._DENSE_TABLE, self._DENSE_PER_KEY * lookups):
            per_cell = torch.bincount(sorted_keys, minlength=table)
            cell_end = torch.cumsum(per_cell, 0)
            cell_begin = cell_end - per_cell
            self.starts = cell_begin[first_key]
            self.counts = cell_end[last_key] - self.starts
        else:
            self.starts = torch.searchsorted(sorted_keys, first_key)
            self.counts = torch.searchsorted(sorted_keys, last_key, right=True) - self.starts

    def candidate_count(self) -> int:
        return int(self.counts.sum())

    def candidate_blocks(
        self, queries: Tensor | None = None, budget: int = PAIR_BUDGET
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield ``(chunk, refs)``: flat query ids (b*M + m) of a chunk of queries and their
        candidates ``refs [len(chunk), W]`` as flat reference ids (b*N + n), padded with -1."""
        if queries is None:
            queries = torch.arange(self.batch * self.num_queries, device=self.starts.device)
        if queries.numel() == 0:
            return
        counts = self.counts.index_select(0, queries)
        starts = self.starts.index_select(0, queries)
        per_query = counts.sum(1)
        width = max(1, int(per_query.max()))
        step = max(1, budget // width)
        for lo in range(0, queries.numel(), step):
            c = counts[lo : lo + step]
            n_q = c.shape[0]
            total = int(c.sum())
            refs = torch.full((n_q, width), -1, dtype=torch.long, device=c.device)
            if total:
                flat_c = c.reshape(-1)
                slot = torch.repeat_interleave(torch.arange(flat_c.numel(), device=c.device), flat_c, output_size=total)
                run = torch.arange(total, device=c.device)
                slot_first = torch.cumsum(flat_c, 0) - flat_c
                pq = per_query[lo : lo + step]
                query_first = torch.cumsum(pq, 0) - pq
                q_local = torch.div(slot, 9, rounding_mode="floor")
                pos = starts[lo : lo + step].reshape(-1).index_select(0, slot) + run - slot_first.index_select(0, slot)
                refs[q_local, run - query_first.index_select(0, q_local)] = self.order.index_select(0, pos)
            yield queries[lo : lo + step], refs


def flat_components(coords: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    flat = coords.detach().transpose(0, 1).reshape(3, -1)
    return flat[0], flat[1], flat[2]


def block_squared_distance(
    qxyz: tuple[Tensor, Tensor, Tensor], rxyz: tuple[Tensor, Tensor, Tensor], chunk: Tensor, refs: Tensor
) -> Tensor:
    """Squared distances ``[Q, W]`` from the chunk's queries to their candidates (pads: inf)."""
    valid = refs >= 0
    r = refs.clamp(min=0)
    q = chunk.unsqueeze(1)
    d2 = squared_distance(qxyz[0][q], qxyz[1][q], qxyz[2][q], rxyz[0][r], rxyz[1][r], rxyz[2][r])
    return d2.masked_fill_(~valid, math.inf)

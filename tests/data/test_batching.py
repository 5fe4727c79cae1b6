"""Disjoint-graph collate and the distributed point-budget batch sampler."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pointforge.data.batching import PairBatch, PointBudgetBatchSampler, collate_pairs
from pointforge.data.pairs.dataset import CloudPair, UpsamplingPairs
from pointforge.data.pairs.scenes import write_synthetic_pairs
from pointforge.errors import ConfigError, DataError
from pointforge.nn.knn import knn_graph


def _item(n, m, index, seed=0):
    gen = torch.Generator().manual_seed(seed + index)
    sparse = torch.randn(n, 3, generator=gen)
    return CloudPair(
        sparse=sparse,
        dense=torch.randn(m, 3, generator=gen),
        edge_index=knn_graph(sparse, 4),
        center=np.array([1000.0 * index, 5.0, -2.0]),
        scale=0.5 + index,
        pair_id=f"p{index}",
        index=index,
    )


def test_collate_builds_disjoint_graphs_with_offsets_and_normalisation():
    items = [_item(5, 9, 0), _item(1, 2, 1), _item(30, 70, 2)]
    batch = collate_pairs(items)
    assert batch.num_clouds == 3 and batch.num_points == 36
    assert batch.sparse_ptr.tolist() == [0, 5, 6, 36] and batch.dense_ptr.tolist() == [0, 9, 11, 81]
    assert batch.sparse_batch.tolist() == [0] * 5 + [1] + [2] * 30
    assert torch.bincount(batch.dense_batch).tolist() == [9, 2, 70]
    assert torch.equal(batch.sparse, torch.cat([it.sparse for it in items]))
    # Each cloud's edges land in its own index range; together they are the shifted originals.
    src, dst = batch.edge_index
    assert torch.equal(batch.sparse_batch[src], batch.sparse_batch[dst])
    assert torch.equal(
        batch.edge_index, torch.cat([items[0].edge_index, items[1].edge_index + 5, items[2].edge_index + 6], 1)
    )
    assert batch.pair_ids == ["p0", "p1", "p2"] and batch.indices.tolist() == [0, 1, 2]
    # Mapping back per cloud, in float64, with each pair's own centre and scale.
    back = batch.denormalize(batch.sparse, batch.sparse_batch)
    for it, arr in zip(items, back):
        assert arr.dtype == np.float64
        assert np.allclose(arr, it.sparse.double().numpy() * it.scale + it.center, rtol=0, atol=1e-9)
    moved = batch.to("cpu")
    assert isinstance(moved, PairBatch) and moved.center.dtype == torch.float64
    with pytest.raises(DataError, match="empty batch"):
        collate_pairs([])


def _check_plan(sampler: PointBudgetBatchSampler, sizes: np.ndarray):
    plan = sampler.plan()
    world = sampler.world_size
    counts = {len(batches) for batches in plan}
    assert len(counts) == 1, "ranks must have equal batch counts"
    assert next(iter(counts)) % sampler.accumulation == 0
    for batches in plan:
        for b in batches:
            load = int(sizes[b].sum())
            assert load <= sampler.max_points or len(b) == 1, (load, b)
            assert sampler.max_clouds is None or len(b) <= sampler.max_clouds
    used = Counter(i for batches in plan for b in batches for i in b)
    extra = sum(used.values()) - len(sizes)
    assert set(used) == set(range(len(sizes)))
    assert extra == sum(len(b) for b in _repeated_batches(plan)) if sampler.repeated else extra == 0
    assert sampler.repeated < world * sampler.accumulation
    # Each rank's view is the same plan (what every rank computes on its own).
    for rank in range(world):
        view = PointBudgetBatchSampler(
            sizes, sampler.max_points, max_clouds=sampler.max_clouds, world_size=world, rank=rank,
            accumulation=sampler.accumulation, seed=sampler.seed, epoch=sampler.epoch,
        )  # fmt: skip
        assert list(view) == plan[rank] and len(view) == len(plan[rank])
    return plan


def _repeated_batches(plan):
    seen, repeats = set(), []
    for batches in plan:
        for b in batches:
            key = tuple(b)
            (repeats.append(b) if key in seen else seen.add(key))
    return repeats


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_sampler_invariants_for_world_sizes_one_to_four(world_size, accumulation):
    rng = np.random.default_rng(world_size)
    sizes = np.exp(rng.uniform(np.log(1_000), np.log(50_000), 57)).astype(np.int64)
    sizes[[3, 40]] = 80_000  # larger than the budget: a batch of its own
    for epoch in range(3):
        sampler = PointBudgetBatchSampler(
            sizes, 60_000, max_clouds=6, world_size=world_size, accumulation=accumulation, seed=11, epoch=epoch
        )
        plan = _check_plan(sampler, sizes)
        assert sampler.repeated == 0  # enough multi-cloud batches to split
        assert any(b == [3] for r in plan for b in r) and any(b == [40] for r in plan for b in r)
        assert sampler.oversize.tolist() == [3, 40]


def test_sampler_is_deterministic_per_epoch_and_seed_and_varies_between_them():
    sizes = np.random.default_rng(0).integers(1_000, 50_000, 80)

    def make(**kw):
        return PointBudgetBatchSampler(sizes, 100_000, world_size=2, **{"seed": 3, "epoch": 0, **kw}).plan()

    assert make() == make()
    assert make() != make(epoch=1)
    assert make() != make(seed=4)
    sampler = PointBudgetBatchSampler(sizes, 100_000, world_size=2, rank=1, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and len(sampler) == len(list(sampler))
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_sampler_fills_the_budget_and_pairs_similar_loads_in_a_step():
    sizes = np.exp(np.random.default_rng(5).uniform(np.log(1_000), np.log(50_000), 400)).astype(np.int64)
    sampler = PointBudgetBatchSampler(sizes, 120_000, world_size=4, seed=0)
    plan = _check_plan(sampler, sizes)
    loads = np.array([[int(sizes[b].sum()) for b in batches] for batches in plan])  # [rank, step]
    assert loads.mean() / 120_000 > 0.85  # first-fit with a window packs tightly
    # The ranks of one step hold neighbouring loads of the sorted list: little waiting at the all-reduce.
    ranked = np.sort(loads.reshape(-1))[::-1]
    expected_groups = {tuple(ranked[i : i + 4]) for i in range(0, len(ranked), 4)}
    assert {tuple(sorted(loads[:, s], reverse=True)) for s in range(loads.shape[1])} == expected_groups


def test_sampler_repeats_a_few_batches_only_when_nothing_can_be_split():
    sizes = np.array([500, 700, 900])
    sampler = PointBudgetBatchSampler(sizes, 10_000, world_size=4, seed=0)
    plan = _check_plan(sampler, sizes)
    assert sampler.repeated == 1 and [len(r) for r in plan] == [1, 1, 1, 1]
    assert _repeated_batches(plan) == [[0]]  # the smallest cloud is the one repeated
    one_each = PointBudgetBatchSampler(sizes, 10_000, max_clouds=1, world_size=2)
    _check_plan(one_each, sizes)
    assert one_each.repeated == 1
    # Splitting alone suffices when there is something to split.
    split = PointBudgetBatchSampler(sizes, 10_000, world_size=3)
    assert [len(r) for r in _check_plan(split, sizes)] == [1, 1, 1] and split.repeated == 0


def test_sampler_rejects_bad_settings():
    with pytest.raises(ConfigError, match="max_points"):
        PointBudgetBatchSampler([10, 20], 0)
    with pytest.raises(ConfigError, match="rank 2"):
        PointBudgetBatchSampler([10, 20], 100, world_size=2, rank=2)
    with pytest.raises(DataError, match="sample 1 has 0 points"):
        PointBudgetBatchSampler([10, 0], 100)
    with pytest.raises(DataError, match="integer point counts"):
        PointBudgetBatchSampler([1.5, 2.0], 100)


def test_dataloader_with_sampler_and_collate_end_to_end(tmp_path):
    manifest = write_synthetic_pairs(tmp_path, [40, 300, 90, 150, 60, 220, 35], seed=0)
    dataset = UpsamplingPairs(manifest)
    sampler = PointBudgetBatchSampler(dataset.sparse_sizes, 400, max_clouds=3, world_size=2, rank=0, seed=1)
    seen = []
    for rank in range(2):
        sampler = PointBudgetBatchSampler(dataset.sparse_sizes, 400, max_clouds=3, world_size=2, rank=rank, seed=1)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_pairs)
        assert len(loader) == len(sampler)
        for batch in loader:
            assert isinstance(batch, PairBatch)
            assert batch.num_points <= 400 and batch.num_clouds <= 3
            assert batch.sparse.shape[0] == int(dataset.sparse_sizes[batch.indices].sum())
            seen.extend(batch.indices.tolist())
    assert sorted(seen) == list(range(len(dataset)))

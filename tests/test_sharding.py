"""Evaluation sharding: every sample exactly once across ranks, no padding, sizes within one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from rankwatch.producers import EvalShardSampler, shard_dataloader, shard_indices


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 15, 16, 17, 100, 1001])
def test_every_sample_exactly_once_and_sizes_within_one(n, world):
    shards = [shard_indices(n, rank, world) for rank in range(world)]
    everything = np.concatenate(shards)
    assert sorted(everything.tolist()) == list(range(n))  # exactly once: no gaps, no duplicates, no padding
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.all(np.diff(s) > 0) for s in shards)  # each shard in ascending order


def test_fewer_samples_than_ranks_leaves_some_ranks_empty():
    sizes = [len(shard_indices(3, rank, 8)) for rank in range(8)]
    assert sizes == [1, 1, 1, 0, 0, 0, 0, 0]


def test_shards_are_strided():
    assert shard_indices(10, 0, 3).tolist() == [0, 3, 6, 9]
    assert shard_indices(10, 2, 3).tolist() == [2, 5, 8]


@pytest.mark.parametrize("n, rank, world", [(10, 3, 3), (10, -1, 3), (10, 0, 0), (-1, 0, 1)])
def test_bad_arguments_are_refused(n, rank, world):
    with pytest.raises(ValueError):
        shard_indices(n, rank, world)


def test_sampler_takes_rank_and_world_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = EvalShardSampler(list(range(7)))
    assert (sampler.rank, sampler.world_size, sampler.dataset_size) == (1, 3, 7)
    assert list(sampler) == [1, 4] and len(sampler) == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_yields_this_ranks_ids_in_order(num_workers):
    n, world = 23, 4
    dataset = TensorDataset(torch.arange(n) * 10)  # the value tells which index the loader read
    seen = []
    for rank in range(world):
        loader = shard_dataloader(dataset, rank, world, batch_size=4, num_workers=num_workers, prefetch_factor=2)
        values = torch.cat([batch for (batch,) in loader]).tolist()
        assert values == [10 * i for i in shard_indices(n, rank, world)]
        seen += values
    assert sorted(seen) == [10 * i for i in range(n)]


def test_dataloader_drops_prefetch_factor_without_workers():
    loader = shard_dataloader(TensorDataset(torch.zeros(4)), 0, 1, batch_size=2, prefetch_factor=4)
    assert loader.prefetch_factor is None
    loader = shard_dataloader(TensorDataset(torch.zeros(4)), 0, 1, batch_size=2, num_workers=1, prefetch_factor=4)
    assert loader.prefetch_factor == 4


def test_dataloader_refuses_what_would_break_the_order():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError):
        shard_dataloader(Stream(), 0, 1)
    with pytest.raises(ValueError, match="shuffle"):
        shard_dataloader(TensorDataset(torch.zeros(4)), 0, 1, shuffle=True)

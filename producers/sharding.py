"""Evaluation sharding: each sample of a validation set is evaluated by exactly one rank.

Strided, like AReaL's ``EvalDistributedSampler`` and torch's ``DistributedSampler`` without its
padding: rank ``r`` of ``w`` takes indices ``r, r + w, r + 2w, …``. Nothing is padded or dropped,
so shard sizes differ by at most one and a rank may get an empty shard when there are fewer
samples than ranks. Striding (rather than contiguous blocks) gives every rank a similar mix of a
validation set sorted by source or difficulty, which keeps the processors' cross-rank consistency
test meaningful. Sample ids are the global dataset indices.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, Sampler

from rankwatch.producers.identity import rank_identity


def shard_indices(n: int, rank: int, world_size: int) -> np.ndarray:
    """The global indices rank ``rank`` of ``world_size`` evaluates, ascending.

    >>> shard_indices(10, 1, 4).tolist()
    [1, 5, 9]
    >>> shard_indices(2, 3, 4).tolist()
    []
    """
    if n < 0:
        raise ValueError(f"dataset size must be >= 0, got {n}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return np.arange(rank, n, world_size, dtype=np.int64)


def _resolve(rank: int | None, world_size: int | None) -> tuple[int, int]:
    # The same defaults as RankPublisher's, so a sampler and a publisher built alike agree.
    default_rank, default_world, _ = rank_identity(os.environ)
    return default_rank if rank is None else rank, default_world if world_size is None else world_size


class EvalShardSampler(Sampler[int]):
    """Yields this rank's global indices of a map-style dataset (or of ``range(n)``), in order.

    ``rank`` / ``world_size`` default to torch.distributed when initialised, else RANK/WORLD_SIZE.
    """

    def __init__(self, data: Sized | int, rank: int | None = None, world_size: int | None = None):
        self.rank, self.world_size = _resolve(rank, world_size)
        self.dataset_size = data if isinstance(data, int) else len(data)
        self.indices = shard_indices(self.dataset_size, self.rank, self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return len(self.indices)


def shard_dataloader(
    dataset: Any,
    rank: int | None = None,
    world_size: int | None = None,
    batch_size: int = 1,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over this rank's shard, in index order (``evaluate_shard`` relies on that order).

    ``prefetch_factor`` only means something with worker processes, so it is passed only when
    ``num_workers > 0`` (torch rejects it otherwise). Other keywords (``collate_fn``,
    ``pin_memory``, ``persistent_workers``…) go to the DataLoader; shuffling is refused.
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError("evaluation sharding needs a map-style dataset (__len__ and __getitem__)")
    for forbidden in ("sampler", "batch_sampler", "shuffle", "drop_last"):
        if loader_kwargs.get(forbidden):
            raise ValueError(f"shard_dataloader sets the order itself; {forbidden}= is not allowed")
        loader_kwargs.pop(forbidden, None)
    if num_workers > 0 and prefetch_factor is not None:
        loader_kwargs["prefetch_factor"] = prefetch_factor
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EvalShardSampler(dataset, rank, world_size),
        num_workers=num_workers,
        **loader_kwargs,
    )


__all__ = ["shard_indices", "EvalShardSampler", "shard_dataloader"]

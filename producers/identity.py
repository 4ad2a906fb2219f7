"""Where this process sits in a distributed job."""

from __future__ import annotations

import sys
from collections.abc import Mapping


def rank_identity(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world_size, local_rank): from an initialised torch.distributed, else ``RANK`` /
    ``WORLD_SIZE`` / ``LOCAL_RANK`` in ``env`` (torchrun sets all three), else (0, 1, 0)."""
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    dist = sys.modules.get("torch.distributed")  # initialised means imported; never import torch here
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, int(env.get("LOCAL_RANK", 0))

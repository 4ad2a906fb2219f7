"""Trainer adapters: rankwatch as a callback of the trainer a user already has.

- ``rankwatch.producers.adapters.huggingface.RankwatchCallback``: a ``transformers.TrainerCallback``;
- ``rankwatch.producers.adapters.lightning.RankwatchCallback``: a Lightning ``Callback``.

Each module imports its library when it is imported itself, so neither library is needed to use
the rest of rankwatch. Both drive a ``TrainerHook`` (``attach=False``) from the trainer's own events
and create a ``RankPublisher.from_env()`` when none is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["batch_size", "release"]


def release(hook: Any, publisher: Any, owns_publisher: bool) -> None:
    """End of training: detach the hook; close a publisher we made, flush one the user gave us."""
    if hook is not None:
        hook.detach()
    if publisher is not None:
        if owns_publisher:
            publisher.close()
        else:
            publisher.flush()


def batch_size(batch: Any) -> int | None:
    """Leading dimension of the first tensor in a (nested) batch; None when there is none.

    >>> import numpy as np
    >>> batch_size({"input_ids": np.zeros((4, 7)), "labels": np.zeros(4)})
    4
    """
    if hasattr(batch, "shape") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size(item)
            if size is not None:
                return size
    return None

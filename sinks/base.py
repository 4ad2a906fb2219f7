"""The sink interface: ``add(alert)`` and ``flush()``. A batching base leaves only ``write(batch)``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from rankwatch.contract import Alert


class Sink(Protocol):
    def add(self, alert: Alert) -> None: ...

    def flush(self) -> None: ...


class BatchingSink(ABC):
    """Buffers alerts and writes them in one go on ``flush()`` (or when ``max_batch`` is reached)."""

    def __init__(self, *, max_batch: int = 100):
        self.max_batch = max_batch
        self._batch: list[Alert] = []

    def add(self, alert: Alert) -> None:
        self._batch.append(alert)
        if len(self._batch) >= self.max_batch:
            self.flush()

    def flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.write(batch)

    @abstractmethod
    def write(self, batch: list[Alert]) -> None:
        """Deliver the batch; raise to report failure (the caller decides what that means)."""

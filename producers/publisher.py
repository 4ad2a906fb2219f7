"""RankPublisher: the one object a training rank talks to.

``log()`` runs on the training thread, so it only appends to a bounded queue (no I/O, no locks
held across I/O, no tensor sync). A daemon sender thread drains the queue, batches many steps of
many metrics into one message per linger period, and hands it to kafka-python. A broker that is
down or slow costs the training thread nothing: the queue bound holds and overflow is counted in
``stats()`` and logged, never silent and never raised.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankwatch.contract import Series, TelemetryBatch
from rankwatch.settings import DEFAULT_BOOTSTRAP

log = logging.getLogger(__name__)

_STOP = object()
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_publishers() -> None:
    # A script that forgets close() should still deliver its last steps.
    for pub in list(_OPEN):
        pub.close(timeout_s=2.0)


def _distributed_defaults() -> tuple[int, int]:
    """(rank, world_size) from an initialised torch.distributed, else RANK/WORLD_SIZE, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _as_float(value: Any) -> float:
    # Tensors are converted here, on the sender thread, so the training thread never syncs a device.
    return float(value.item() if hasattr(value, "item") else value)


@dataclass(frozen=True)
class PublisherStats:
    logged: int  # log() calls accepted
    dropped: int  # log() / send() calls refused because the queue was full
    sent: int  # messages acknowledged by the broker
    failed: int  # messages the broker never acknowledged (after kafka-python's retries)
    queued: int  # items waiting for the sender


class RankPublisher:
    """Publishes one rank's metrics to ``rankwatch.telemetry``.

    >>> pub = RankPublisher(run="exp1", rank=0, world_size=1, bootstrap="127.0.0.1:1", connect_timeout_s=0.1)
    >>> pub.log({"loss": 0.5}, step=0)  # returns at once even with no broker
    >>> pub.close(timeout_s=0.5)
    """

    def __init__(
        self,
        *,
        run: str,
        rank: int | None = None,
        world_size: int | None = None,
        bootstrap: str = DEFAULT_BOOTSTRAP,
        max_queue: int = 100_000,
        linger_s: float = 0.02,
        max_batch: int = 4096,
        connect_timeout_s: float = 5.0,
        producer_config: Mapping[str, Any] | None = None,
    ):
        default_rank, default_world = _distributed_defaults()
        self.run = run
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not run or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need a run name and 0 <= rank < world_size, got {run!r}, {self.rank}, {self.world_size}")
        self.bootstrap = bootstrap
        self.linger_s, self.max_batch = linger_s, max_batch
        self.connect_timeout_s = connect_timeout_s
        self.producer_config = dict(producer_config or {})
        # A fresh id per incarnation: a restarted rank numbers its messages from 0 again.
        self.producer_id = uuid.uuid4().hex[:12]
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._seq = 0
        self._logged = self._dropped = self._sent = self._failed = 0
        self._producer = None
        self._retry_at = 0.0  # no reconnect attempt before this (monotonic seconds)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-sender-{self.rank}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # -- training thread -------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue ``metrics`` (floats or 0-d tensors) for ``step``. Never blocks, never raises on I/O."""
        try:
            self._queue.put_nowait((step, metrics))
            self._logged += 1
        except queue.Full:
            self._count_drop()

    def _count_drop(self) -> None:
        self._dropped += 1
        if self._dropped & (self._dropped - 1) == 0:  # log at 1, 2, 4, 8… drops, not every time
            log.warning("rankwatch queue full (%d items): %d items dropped so far", self._queue.maxsize, self._dropped)

    def send(self, event: Any) -> None:
        """Queue any contract event (e.g. an ``EvalShard``) for its topic. Never blocks, never raises on I/O."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._count_drop()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything logged so far is acknowledged (or failed); True if it finished in time."""
        deadline = time.monotonic() + timeout_s
        marker = threading.Event()  # FIFO: when the sender reaches it, everything before is handed over
        try:
            self._queue.put(marker, timeout=timeout_s)
        except queue.Full:
            return False
        if not marker.wait(timeout_s):
            return False
        if self._producer is not None:
            try:
                self._producer.flush(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # KafkaTimeoutError: the broker is away; the counts say so
                return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what can be flushed within ``timeout_s``, then stop the sender thread."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        try:
            self._queue.put(_STOP, timeout=max(0.01, deadline - time.monotonic()))
        except queue.Full:
            pass  # the daemon sender dies with the process
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._producer is not None:
            self._producer.close(timeout=max(0.0, deadline - time.monotonic()))

    def stats(self) -> PublisherStats:
        return PublisherStats(self._logged, self._dropped, self._sent, self._failed, self._queue.qsize())

    def __enter__(self) -> RankPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sender thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            deadline = time.monotonic() + self.linger_s
            while len(items) < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    items.append(self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait())
                except queue.Empty:
                    break
            points = [item for item in items if isinstance(item, tuple)]
            events = [item for item in items if hasattr(item, "to_bytes")]
            if points:
                events.insert(0, self._build(points))
            for event in events:
                try:
                    self._send(event)
                except Exception:  # the sender must outlive any one bad event
                    log.exception("rankwatch: could not publish a %s event", getattr(event, "KIND", "?"))
                    self._failed += 1
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is _STOP for item in items):
                return

    def _build(self, items: list[tuple[int, Mapping[str, Any]]]) -> TelemetryBatch:
        steps: dict[str, list[int]] = defaultdict(list)
        values: dict[str, list[float]] = defaultdict(list)
        for step, metrics in items:
            for name, value in metrics.items():
                steps[name].append(step)
                values[name].append(_as_float(value))
        batch = TelemetryBatch(
            run=self.run, rank=self.rank, world_size=self.world_size, producer=self.producer_id,
            seq=self._seq, ts=time.time(),
            series={n: Series(np.asarray(steps[n], dtype=np.int64), np.asarray(values[n])) for n in steps},
        )
        self._seq += 1
        return batch

    def _send(self, event: Any) -> None:
        producer = self._connect()
        if producer is None:
            self._failed += 1
            return
        key = event.key if isinstance(event.key, bytes) else event.key.encode()
        future = producer.send(event.TOPIC, event.to_bytes(), key=key)
        future.add_callback(self._on_sent).add_errback(self._on_error)

    def _on_sent(self, _metadata) -> None:
        self._sent += 1

    def _on_error(self, exc: Exception) -> None:
        self._failed += 1
        log.warning("rankwatch: telemetry batch not delivered: %s", exc)

    def _connect(self):
        if self._producer is not None or time.monotonic() < self._retry_at:
            return self._producer
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        try:
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                client_id=f"rankwatch-{self.run}-{self.rank}",
                acks=1,
                linger_ms=5,
                max_block_ms=int(self.connect_timeout_s * 1000),
                bootstrap_timeout_ms=int(self.connect_timeout_s * 1000),
                request_timeout_ms=10_000,
                retries=5,
                **self.producer_config,
            )
        except KafkaError as exc:
            self._retry_at = time.monotonic() + self.connect_timeout_s
            log.warning("rankwatch: broker %s unreachable (%s); batches are counted as failed", self.bootstrap, exc)
        return self._producer

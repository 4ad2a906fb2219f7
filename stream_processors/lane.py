"""The NaN lane read by a consumer of its own, so that a page never waits behind telemetry (issue 16).

Faust reads every topic through one consumer and hands out a poll's records partition by partition,
each to its end, into stream buffers that stage 1 drains at about a millisecond a message: a lane
record fetched beside a telemetry backlog waited seconds for its turn. ``LaneReader`` is a thread
with a kafka-python consumer of its own on the lane partitions this worker owns, read from their end
when it gets them, that hands each record to the event loop as soon as it is fetched.

Faust's agent still reads the lane too, from its committed offset. It is what keeps the lane
at-least-once across restarts and rebalances; the reader is only a shortcut. ``LaneMarks`` says
which of the two applies a record: whichever reaches it first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

from kafka import KafkaConsumer, TopicPartition

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 10  # Tansu does not wake a long-poll fetch when data arrives (its note 3): keep the wait short
RETRY_S = 1.0  # after the reader's consumer failed (the broker away): the agent has the lane meanwhile


class LaneMarks:
    """Which of the two readers of a lane partition applies each record. Pure; used on the event loop."""

    def __init__(self) -> None:
        self._reached: dict[int, int] = {}  # partition -> the last offset Faust's agent reached
        self._ahead: dict[int, set[int]] = {}  # offsets the reader applied that the agent has not reached

    def by_reader(self, partition: int, offset: int) -> bool:
        """Whether the reader applies this record; if so, the agent will not."""
        ahead = self._ahead.setdefault(partition, set())
        if offset <= self._reached.get(partition, -1) or offset in ahead:
            return False
        ahead.add(offset)
        return True

    def by_agent(self, partition: int, offset: int) -> bool:
        """Whether the agent applies this record: not if the reader did."""
        self._reached[partition] = offset
        ahead = self._ahead.get(partition)
        if not ahead:
            return True
        applied = offset in ahead
        self._ahead[partition] = {o for o in ahead if o > offset}
        return not applied

    def release(self, partition: int, offset: int) -> None:
        """The reader failed to apply a record it took: the agent applies it (or dead-letters it)."""
        self._ahead.get(partition, set()).discard(offset)

    def forget(self, partitions: Collection[int]) -> None:
        """Partitions handed to another worker: what happens to them now is its business."""
        for p in partitions:
            self._reached.pop(p, None)
            self._ahead.pop(p, None)


class LaneReader(threading.Thread):
    """Reads the lane partitions in ``wanted`` and calls ``deliver(partition, offset, value)`` for each
    record, on this thread. A partition is read from its end when it is first wanted: the records
    before that are the agent's. Set ``wanted`` from the event loop; ``stop()`` ends the thread."""

    def __init__(self, bootstrap: str, topic: str, deliver: Callable[[int, int, bytes], None],
                 client: dict[str, Any] | None = None):
        super().__init__(name="rankwatch-lane", daemon=True)
        self.bootstrap, self.topic, self.deliver = bootstrap, topic, deliver
        self.client = client or {}  # kafka-python settings: security
        self.wanted: frozenset[int] = frozenset()
        self._stopping = threading.Event()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:  # noqa: D102 (Thread.run)
        failed = False
        while not self._stopping.is_set():
            try:
                self._read()
            except Exception as exc:  # noqa: BLE001 (the agent still reads the lane: a shortcut lost, nothing else)
                if not failed:
                    log.warning("the NaN lane's own reader failed (%s: %s); Faust's agent reads the lane "
                                "meanwhile, and the reader retries every %.0f s", type(exc).__name__, exc, RETRY_S)
                failed = True
                self._stopping.wait(RETRY_S)
            else:
                failed = False

    def _read(self) -> None:
        # Back soon after a broker outage: kafka-python's backoff grows to tens of seconds by default.
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                 fetch_max_wait_ms=FETCH_WAIT_MS, reconnect_backoff_max_ms=1000, **self.client)
        try:
            have: frozenset[int] = frozenset()
            while not self._stopping.is_set():
                wanted = self.wanted
                if wanted != have:
                    consumer.assign([TopicPartition(self.topic, p) for p in sorted(wanted)])
                    new = [TopicPartition(self.topic, p) for p in sorted(wanted - have)]
                    if new:
                        consumer.seek_to_end(*new)
                    have = wanted
                if not have:
                    self._stopping.wait(0.1)
                    continue
                for tp, records in consumer.poll(timeout_ms=100).items():
                    for record in records:
                        self.deliver(tp.partition, record.offset, record.value)
        finally:
            consumer.close()

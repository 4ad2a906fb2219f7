"""The NaN lane read by a consumer of its own, so that a page never waits behind telemetry (issue 16).

Faust reads every topic through one consumer and hands out a poll's records partition by partition,
each to its end, into stream buffers that stage 1 drains at about a millisecond a message: a lane
record fetched beside a telemetry backlog waited seconds for its turn. ``LaneReader`` is a thread
with a kafka-python consumer of its own on the lane partitions this worker owns, read from their end
when it gets them, that hands each record to the event loop as soon as it is fetched.

Faust's agent still reads the lane too, from its committed offset. It is what keeps the lane
at-least-once across restarts and rebalances; the reader is only a shortcut. ``LaneMarks`` says
which of the two applies a record: whichever reaches it first. ``LanePager`` groups and pages the
reader's records on the reader's thread, so that a page waits for no event loop either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from rankwatch.contract import URGENT, Alert, UrgentTelemetry
from rankwatch.stream_processors.alert_sender import Paging
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import RunGroups
from rankwatch.stream_processors.rules import Rules
from rankwatch.stream_processors.urgent import urgent_signals

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 10  # Tansu does not wake a long-poll fetch when data arrives (its note 3): keep the wait short
POLL_S = 0.1
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
    before that are the agent's. ``tick()``, if given, is called after each poll, on this thread too,
    and returns how many seconds it wants to wait for the next call at most. Set ``wanted`` from the
    event loop; ``stop()`` ends the thread."""

    def __init__(self, bootstrap: str, topic: str, deliver: Callable[[int, int, bytes], None],
                 client: dict[str, Any] | None = None, tick: Callable[[], float] | None = None):
        super().__init__(name="rankwatch-lane", daemon=True)
        self.bootstrap, self.topic, self.deliver, self.tick = bootstrap, topic, deliver, tick
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
            wait_s = POLL_S
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
                for tp, records in consumer.poll(timeout_ms=max(1, int(wait_s * 1000))).items():
                    for record in records:
                        self.deliver(tp.partition, record.offset, record.value)
                wait_s = POLL_S if self.tick is None else min(POLL_S, self.tick())
        finally:
            consumer.close()


class LanePager:
    """The lane's pages decided on the reader's thread (issue 16): at 1,024 ranks on two cores the
    event loop took a lane record up to 0.2 s after the reader handed it over and grouped it up to
    0.4 s later, so a NaN's page waited for the loop it exists to skip.

    A run is paged here once the loop has seen it on the partition (``partitions``, set from stage 2
    and the loop's lane path) and its groups are in memory (``groups_of``); its first lane record
    before that is handed to the loop (``connect``). Decisions go through ``Paging`` (one lock, one
    order, with the loop's).
    """

    def __init__(self, *, rules: Rules, grouper: Grouper, paging: Paging,
                 groups_of: Callable[[bytes], RunGroups | None], ready: Callable[[], bool]):
        self.rules, self.grouper, self.paging, self.groups_of, self.ready = rules, grouper, paging, groups_of, ready
        self.handoff: Callable[[int, int, bytes], None] | None = None
        self.kept: Callable[[bytes, RunGroups, Future | None], None] | None = None
        self.marks = LaneMarks()  # which of the lane's two readers applies each record (under paging.lock)
        self.partitions: dict[bytes, int] = {}  # run -> the partition its groups are on in this worker
        self._waiting: dict[bytes, RunGroups] = {}  # runs with a group this thread flushes when due

    def connect(self, handoff: Callable[[int, int, bytes], None],
                kept: Callable[[bytes, RunGroups, Future | None], None]) -> None:
        """The loop's side, before the reader starts: ``handoff(partition, offset, value)`` takes a
        record to the loop; ``kept(key, state, sent)`` is told of each decision that changed a run's
        groups, with the future of its alerts (None if none were due), so that the loop writes the
        groups once their alerts are in."""
        self.handoff, self.kept = handoff, kept

    def deliver(self, partition: int, offset: int, value: bytes) -> None:
        """A lane record, on the reader's thread."""
        if not self.ready():  # a rebalance or recovery: the run's state may not be here yet; the agent applies it
            return
        try:
            batch = UrgentTelemetry.from_bytes(value)
        except Exception:  # noqa: BLE001 (the agent dead-letters it, with why)
            return
        key = batch.run.encode()
        state = self.groups_of(key)
        if state is None or self.partitions.get(key) != partition:
            self.handoff(partition, offset, value)
            return
        now, applied = time.time(), []

        def decision() -> list[Alert]:
            if not self.marks.by_reader(partition, offset):
                return []
            applied.append(offset)
            self._waiting[key] = state
            return self.grouper.add_all(state, urgent_signals(self.rules, batch, now), now)

        try:
            sent = self.paging.decide(decision)
        except Exception:  # noqa: BLE001 (the agent applies it again, and dead-letters it if it fails there)
            log.exception("urgent %s[%d]@%d failed on the lane's own reader", URGENT, partition, offset)
            with self.paging.lock:
                self.marks.release(partition, offset)
            return
        if applied:
            self.kept(key, state, sent)

    def tick(self) -> float:
        """Send the groups that are due, on the reader's thread; seconds until the next one is."""
        now, soonest = time.time(), POLL_S
        for key, state in list(self._waiting.items()):
            sent = self.paging.decide(self.grouper.tick, state, now) if self.ready() else None
            if sent is not None:
                self.kept(key, state, sent)
            with self.paging.lock:
                due = self.grouper.due_in(state, now)
                if due is None:
                    self._waiting.pop(key, None)
                else:
                    soonest = min(soonest, due)
        return soonest

    def forget(self, runs: Collection[bytes] = (), partitions: Collection[int] = (), *, everything: bool = False) -> None:
        """Runs expired, or lane partitions handed over (``everything``: a rebalance); on the loop."""
        with self.paging.lock:
            if everything:  # until the loop sees a run again, its records go to the loop
                self.partitions.clear()
                self._waiting.clear()
            for key in runs:
                self.partitions.pop(key, None)
                self._waiting.pop(key, None)
            self.marks.forget(partitions)

"""The store sink: reads ``rankwatch.reports`` and ``rankwatch.alerts`` into the report store.

A plain kafka-python consumer with manual assignment (no group: one store has one writer, and the
embedded broker's group joins are slow). It starts each partition at the offset the store committed
with its rows, so nothing is lost or stored twice across restarts. Each poll's records are written
in one transaction. The run-wide rows (``store_rollups``) are merged at most every
``MERGE_EVERY_S``, and before ``run`` returns: merged with every poll, the windows of 1,024 ranks
closing together cost the store 20 CPU seconds a window on two cores shared with the workers, and
merged whenever a poll found nothing new they still cost most of that, since the workers' rollups
of a window trickle in over a second or two.

A broker that lost its topics (the embedded one keeps nothing across a restart) restarts offsets at
0: a stored position past the end is out of range, and the consumer starts that partition over
(``auto_offset_reset="earliest"``). The rows it writes again are the same rows (idempotent upserts).
That reset happens only while the new broker's partition is still shorter than the stored position: for a
broker known to have started empty (the embedded one a Stack has just started) ``from_beginning=True``
ignores the stored positions, so what reached it before the sink's first read is stored too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from kafka import KafkaConsumer, TopicPartition

from rankwatch import contract
from rankwatch.security import PLAINTEXT, KafkaSecurity
from rankwatch.sinks.reader import caught_up
from rankwatch.sinks.store import ReportStore, WriteResult

log = logging.getLogger(__name__)

TOPICS = (contract.REPORTS, contract.ALERTS)
#: Longest a run-wide row waits behind its ranks' rows (plus one poll).
MERGE_EVERY_S = 2.0


class StoreSink:
    """``run()`` copies the topics into ``store`` until caught up (``follow=False``) or ``stop()``."""

    #: SASL/TLS of its consumer; set on an instance (``rankwatch store`` gives the settings' one).
    security: KafkaSecurity = PLAINTEXT

    def __init__(self, store: ReportStore, bootstrap: str, *, poll_ms: int = 200, max_records: int = 2000,
                 on_write: Callable[[WriteResult], None] | None = None, from_beginning: bool = False):
        self.store, self.bootstrap, self.from_beginning = store, bootstrap, from_beginning
        self.poll_ms, self.max_records, self.on_write = poll_ms, max_records, on_write
        self.written = 0

    def run(self, *, follow: bool = True, stop: Callable[[], bool] | None = None,
            stop_after_s: float | None = None, drain_s: float = 0.0) -> None:
        """``stop()`` ends a following run; with ``drain_s`` it first stores what is on the topics by then
        (for at most that long): what the workers sent last before a Stack stopped them."""
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
            fetch_max_wait_ms=100, client_id="rankwatch-store", allow_auto_create_topics=False,
            **self.security.kafka_python(),
        )
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s

        def more() -> bool:
            nonlocal follow, deadline, stop
            if stop is not None and stop():
                if not (follow and drain_s > 0):
                    return False
                follow, stop = False, None  # read up to the end once, then return
                deadline = min(deadline or math.inf, time.monotonic() + drain_s)
            return deadline is None or time.monotonic() < deadline

        try:
            assigned: list[TopicPartition] = []
            next_check = 0.0
            unmerged, merge_at = True, 0.0  # a crash may have left windows to merge
            while more():
                if time.monotonic() >= next_check:  # topics appear when the workers create them
                    assigned = self._assign(consumer, assigned)
                    next_check = time.monotonic() + (10.0 if len(assigned) and self._all_topics(assigned) else 0.5)
                if not assigned:
                    if not follow:
                        break
                    time.sleep(0.2)
                    continue
                got = consumer.poll(timeout_ms=self.poll_ms, max_records=self.max_records)
                records = [(r.topic, r.partition, r.offset, r.value) for batch in got.values() for r in batch]
                if records:
                    result = self.store.write(records, merge=False)
                    unmerged = True
                    self.written += len(records)
                    if self.on_write:
                        self.on_write(result)
                if unmerged and time.monotonic() >= merge_at:
                    self.store.merge()
                    unmerged, merge_at = False, time.monotonic() + MERGE_EVERY_S
                if not records and not follow and caught_up(consumer, assigned):
                    break
            if unmerged:
                self.store.merge()
        finally:
            consumer.close()

    def _assign(self, consumer: KafkaConsumer, assigned: list[TopicPartition]) -> list[TopicPartition]:
        tps = [TopicPartition(t, p) for t in TOPICS for p in sorted(consumer.partitions_for_topic(t) or ())]
        if set(tps) == set(assigned):
            return assigned
        known = set(assigned)
        consumer.assign(tps)
        offsets = self.store.offsets()
        for tp in tps:
            if tp in known:
                continue  # keep reading where we are
            start = None if self.from_beginning else offsets.get((tp.topic, tp.partition))
            if start is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, start)
        return tps

    @staticmethod
    def _all_topics(tps: list[TopicPartition]) -> bool:
        return {tp.topic for tp in tps} == set(TOPICS)

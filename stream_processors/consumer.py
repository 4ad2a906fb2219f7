"""Faust's aiokafka consumer, except that records it fetched and then dropped are fetched again.

faust-streaming's ``Consumer.getmany`` takes a batch of records from aiokafka, which moves each
partition's position past them, and hands them over one by one. It skips the records of a
partition that is not active at that moment (paused for a table's recovery, say), and stops
handing over the rest when the consumer generation changes or flow stops. Nothing fetches those
records again unless a later seek happens to cover them: a worker then sat idle for good with
records in its partitions (issue 19; ``fetchwatch`` finds such partitions seconds later, this
finds them at once).

So once a batch has been handed over, each partition that still belongs to the worker, with
records of the batch not handed over, is sought back to the first of them. Only when nothing
moved the position since: a new generation (aiokafka starts every partition of a new assignment
at its committed offset) or any seek of Faust's own (to the committed offset, which is never past
a record not handed over) already put those records in front of the consumer again, and seeking
forward to them would skip what lies before.

Within a batch, a partition's records go to the stream in order or not at all. Faust skips the
records of a partition that is inactive at that moment and hands over its later records once it is
active again (most likely its stream's buffer was full, then drained), so a stream got 258-285 and
then 290-299 (the two-worker failover test beside two busy processes): stage 1 then drops the
skipped records as replays when they come again, since their ranks' later messages were applied.
Once a partition's record is skipped, its later records of the batch are held back too, and the
partition is sought back to the first skipped one.

It also never commits past the next record to process while that record is unacknowledged.
Faust's ``_new_offset`` commits the longest run of acknowledged offsets, and only holds back when
that run starts two or more past the committed offset, or not at all when nothing is committed yet
([faust#606](https://github.com/faust-streaming/faust/issues/606), open). So a record at the head
that was never acknowledged is committed over when the records after it are: one that a rebalance
made Faust drop, or one still waiting for its state write while records of other ranks after it
were written first. Either way nothing reads it again, and the watch, which goes by the committed
offset, sees nothing wrong. This and the skipping above are what lost a rank's windows now and then
in the failover tests on the 3-broker cluster (docs/operations.md has the runs).

Written for faust-streaming 0.15.x and aiokafka 0.14.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from intervaltree import IntervalTree

log = logging.getLogger(__name__)


def not_handed_over(batch: Mapping[TP, list[Any]], handed: Mapping[TP, int]) -> dict[TP, int]:
    """Per partition of ``batch``, the offset of its first record after the last one ``handed`` over."""
    first = {}
    for tp, records in batch.items():
        after = handed.get(tp, -1)
        offset = next((r.offset for r in records if r.offset > after), None)
        if offset is not None:
            first[tp] = offset
    return first


def head_unacked(acked: list[int], head: int | None, gaps: IntervalTree) -> bool:
    """Whether committing ``acked`` would pass ``head``, the next offset to process, though it was
    neither acknowledged nor a gap in the log (a compacted or transaction-marker offset).

    >>> head_unacked([32, 33], 31, IntervalTree())  # Faust would commit 34: offset 31 lost
    True
    >>> head_unacked([31, 32], 31, IntervalTree()), head_unacked([32, 33], 31, IntervalTree.from_tuples([(31, 32)]))
    (False, False)
    """
    return bool(acked) and head is not None and min(acked) > head and not gaps.overlaps(head)


class InOrder:
    """Which records of a fetched ``batch`` may go to a stream: each partition's from its first, with
    none skipped. ``handed``: per partition, the last one that went.

    >>> from collections import namedtuple
    >>> record = namedtuple("record", "offset")
    >>> order = InOrder({"p": [record(o) for o in range(10, 16)]})
    >>> [order.allows("p", o) for o in (10, 11, 14, 15)], order.handed  # 12 and 13 were skipped
    ([True, True, False, False], {'p': 11})
    """

    def __init__(self, batch: Mapping[TP, list[Any]] | None) -> None:
        self._batch, self._next, self.handed = batch or {}, {}, {}

    def allows(self, tp: TP, offset: int) -> bool:
        records, i = self._batch.get(tp, ()), self._next.get(tp, 0)
        if i is None or i >= len(records) or records[i].offset != offset:
            self._next[tp] = None  # one was skipped: the rest wait for the seek back
            return False
        self._next[tp], self.handed[tp] = i + 1, offset
        return True


class Consumer(faust_aiokafka.Consumer):
    _batch: Mapping[TP, list[Any]] | None = None
    _seeks = 0  # Faust's own seeks so far

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per partition since it was assigned: the first offset fetched, its head until a commit.
        self._first_fetched: dict[TP, int] = {}

    async def _wait_next_records(self, timeout: float):
        records, active = await super()._wait_next_records(timeout)
        self._batch = records
        for tp, batch in (records or {}).items():
            if batch:
                self._first_fetched.setdefault(tp, batch[0].offset)
        return records, active

    async def on_partitions_revoked(self, revoked) -> None:
        for tp in revoked:
            self._first_fetched.pop(tp, None)
        await super().on_partitions_revoked(revoked)

    def _new_offset(self, tp: TP) -> int | None:
        head = self._committed_offset[tp]  # Faust keeps a committed 0 as None
        if head is None:
            head = self._first_fetched.get(tp)
        if head_unacked(self._acked[tp], head, self._gap[tp]):
            return None  # the fetch watch reads it again if no stream has it (``fetchwatch``)
        return super()._new_offset(tp)

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Any]]:
        generation, seeks, order = self.app.consumer_generation_id, self._seeks, None
        try:
            async for tp, message in super().getmany(timeout):
                order = order or InOrder(self._batch)  # the batch is fetched by the first step
                if order.allows(tp, message.offset):
                    yield tp, message
        finally:
            batch, self._batch = self._batch, None
            if batch and not self.should_stop and generation == self.app.consumer_generation_id and seeks == self._seeks:
                try:
                    self._fetch_again(not_handed_over(batch, order.handed if order else {}))
                except Exception:  # an error here would end the fetch loop: the watch seeks back later
                    log.exception("seeking back records not handed to a stream failed")

    def _fetch_again(self, first: Mapping[TP, int]) -> None:
        assigned = self.assignment()
        for tp, offset in first.items():
            if tp in assigned:
                log.info("%s[%d]: records from offset %d were fetched but not handed to a stream; fetching them again",
                         tp.topic, tp.partition, offset)
                self._thread.seek(tp, offset)  # what Faust's own ``seek`` does, without its await
                self._read_offset[tp] = offset or None

    async def seek(self, partition: TP, offset: int) -> None:
        self._seeks += 1
        await super().seek(partition, offset)

    async def seek_to_committed(self) -> Mapping[TP, int]:
        self._seeks += 1
        return await super().seek_to_committed()

    async def seek_wait(self, partitions: Mapping[TP, int]) -> None:
        self._seeks += 1
        await super().seek_wait(partitions)

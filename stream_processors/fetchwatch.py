"""Partitions whose records the consumer fetched but no stream was given, found and sought back.

Seen on a 3-broker Apache Kafka cluster after a worker was killed and its partner took its
partitions over (issue 19): the survivor sat idle for good with no error, aiokafka's fetch position
at the end of three telemetry partitions, Faust's committed offset and last delivered offset half
way. faust-streaming's ``Consumer.getmany`` takes a batch of records from aiokafka (which moves the
position past them) and hands them to the streams one by one; when a rebalance starts meanwhile it
stops handing them over (the generation check, and the active-partition filter, whose set the
rebalance empties in place) and drops the rest. Unless another rebalance seeks the partition back,
nothing ever reads those records again. (The same family: faust-streaming issues 216 and 221.)

The watch asks, every 2 s, of each partition with no record given to a stream and not yet
acknowledged: is its fetch position, or its end, beyond its committed offset? Seen so for four
seconds with nothing changing (an acknowledged record is committed within Faust's commit interval),
it is stuck, and the worker seeks it back to its committed offset, which also resets the offset
Faust skips records below. Per partition, not per worker: a worker that always has some records
in flight (acknowledgements wait for the state writes, every ``state_write_s``) would otherwise
never check, and a partition stuck for longer than a stall bound makes its ranks look stalled.
Replays are harmless (every stage drops what it already applied); a record never read is not.

A seek is not always enough. Faust asks aiokafka for records of its *active* partitions only, and
takes a partition out of that set while a stream's buffer is under pressure, putting it back when
the buffer drains (``Consumer.on_buffer_full`` / ``on_buffer_drop``). If the buffer is emptied by a
rebalance instead of drained, the call that puts it back never comes, and a partition assigned,
not paused, with nothing in flight is never fetched again, whatever it is sought to. So a stuck
partition is also put back into the fetched set (``refetch``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Hashable, Protocol


@dataclass(frozen=True)
class Offsets:
    position: int | None  # the consumer's fetch position: the next offset aiokafka returns
    delivered: int | None  # the last offset Faust gave a stream (or its seek target after a seek)
    committed: int | None  # the group's committed offset: the next one to process after a restart
    end: int | None = None  # the partition's end offset (its high watermark)

    def behind(self) -> bool:
        """Whether the partition holds records past its committed offset. With none of its records
        in flight (every one Faust gave a stream acknowledged) those are records no stream will get:
        fetched and dropped, or never fetched at all (a restarted worker sat idle for good with a
        partition at its committed offset and records after it, issue 19).

        Faust's own last delivered offset is no guide: its fetch loop sets it after handing a record
        over, also when a rebalance made it give that record up, and records below it are then
        skipped as already read. Trusting it, this watch stayed silent while two ranks' first
        windows never rolled up after a 1 -> 2 worker rebalance (3-broker cluster, 2026-12-03)."""
        last = max((o for o in (self.position, self.end) if o is not None), default=None)
        return last is not None and last > (self.committed or 0)


@dataclass
class FetchWatch:
    # Checks in a row that see the same partition behind and unchanged; at one check every 2 s, four
    # seconds, over Faust's commit interval (2.8 s), so a partition acknowledged but not yet
    # committed is never taken for stuck.
    patience: int = 3
    _suspects: dict[Hashable, tuple[Offsets, int]] = field(default_factory=dict)

    def check(self, *, busy: Collection[Hashable], offsets: Mapping[Hashable, Offsets]) -> list[Hashable]:
        """The partitions to seek back: behind, unchanged, and not ``busy`` (records given to a
        stream and not yet acknowledged) on ``patience`` checks in a row."""
        suspects, stuck = {}, []
        for tp, now in offsets.items():
            if tp in busy or not now.behind():
                continue  # busy: records may be on their way to a stream, nothing can be told
            before, seen = self._suspects.get(tp, (None, 0))
            seen = seen + 1 if before == now else 1
            if seen >= self.patience:
                stuck.append(tp)
            else:
                suspects[tp] = (now, seen)
        self._suspects = suspects
        return stuck


class FaustFetchSets(Protocol):
    """The parts of faust-streaming's ``Consumer`` (0.15.x) that decide which partitions are fetched."""

    _active_partitions: set | None
    _paused_partitions: set
    _buffered_partitions: set


def refetch(consumer: FaustFetchSets, tp: Hashable) -> str | None:
    """Put a stuck, unpaused partition back into the set Faust fetches; say what was wrong, if anything."""
    if tp in consumer._paused_partitions or consumer._active_partitions is None or tp in consumer._active_partitions:
        return None
    how = "held as buffered" if tp in consumer._buffered_partitions else "missing"
    consumer._buffered_partitions.discard(tp)
    consumer._active_partitions.add(tp)
    return f"{how} from the partitions Faust fetches"

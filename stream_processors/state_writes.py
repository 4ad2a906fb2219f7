"""Rank state written to its changelog on a schedule, with the acks of what it applied held until then.

A rank's state (its detectors' histories, conditions and open rollup windows) is tens of KB. Written
once per batch, at 1 Hz that is once per message: a quarter of a worker's time in encoding, and at
1,024 ranks about 80 MB/s of changelog, which the embedded broker keeps in memory for good (issue 16).
Written every few seconds instead, each rank's latest state goes out once.

What makes that safe is the order: an applied message is acknowledged only after the state that
records it has been handed to the table. The committed offset therefore never passes the written
state; a worker that dies in between is replayed from the commit onto the last written state, whose
dedup cursor (``RankState.seq``) skips what that state already holds. Outputs were sent before
(``topics.send_all``), so a replay can repeat them, never lose them: at least once, as before.

At 1,024 ranks one write is about 60 MB of msgpack, half a second or more of the event loop, and
the NaN lane's pages waited behind it (issue 16). ``write_gradually`` hands the states over a slice
at a time and lets the loop run in between; the acks still wait for the last slice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Any

import faust

from rankwatch.stream_processors.tables import is_part


class StateWrites:
    """A table's writes held back and sent together, with the events whose acks wait for them.

    Read through it (``get``): a state not written yet is the newest one, and a key whose first
    state is still held is not in the table at all.
    """

    def __init__(self, table: faust.Table, every_s: float):
        self.table, self.every_s = table, every_s
        self._states: dict[Any, Any] = {}
        self._events: list[faust.EventT] = []
        self._writing: dict[Any, Any] = {}  # states of the write under way, not yet handed to the table
        self._writing_events: list[faust.EventT] = []  # acked once ``_writing`` is empty
        self._last = float("-inf")
        self._touched: set = set()  # keys given a state since the last ``expire``
        self._seen: dict[Any, float] = {}  # key -> when ``expire`` last saw it change (or first saw it)

    def __len__(self) -> int:
        return len(self._events) + len(self._writing_events)

    def get(self, key: Any) -> Any:
        for held in (self._states, self._writing):
            found = held.get(key)
            if found is not None:
                return found
        return self.table.get(key)

    def keys(self) -> list:
        """The table's keys and those whose first state is not written yet."""
        unwritten = {**self._writing, **self._states}
        return [*self.table.keys(), *(key for key in unwritten if key not in self.table)]

    def add(self, events: Sequence[faust.EventT], states: Mapping[Any, Any]) -> None:
        """``events`` were applied, giving ``states`` (by table key); both wait for the next ``write``."""
        self._states.update(states)  # the latest state of a key holds everything before it
        self._touched.update(states)
        self._events += events

    def due(self, now: float, *, now_anyway: bool = False) -> bool:
        return bool(self._events or self._states or self._writing_events or self._writing) and (now_anyway or now - self._last >= self.every_s)

    def write(self, now: float) -> None:
        """Hand every pending state to the table, then acknowledge the events they record.

        Synchronous, so that it can run wherever Faust gives a hook; it also finishes a
        ``write_gradually`` under way. ``Event.ack`` is what ``Stream.ack`` does besides telling the
        monitor's counters.
        """
        self._start(now)
        self._step(len(self._writing))

    async def write_gradually(self, now: float, slice_size: int = 32) -> None:
        """``write``, ``slice_size`` states at a time, letting the event loop run between slices."""
        if self._writing or self._writing_events:
            return  # one under way: it takes these too when it ends, or the next one does
        self._start(now)
        while not self._step(slice_size):
            await asyncio.sleep(0)

    def _start(self, now: float) -> None:
        self._writing.update(self._states)  # the latest state of a key holds everything before it
        self._writing_events += self._events
        self._states, self._events, self._last = {}, [], now

    def _step(self, n: int) -> bool:
        """Hand up to ``n`` states to the table; once none is left, ack; whether it is done."""
        for key in list(islice(self._writing, n)):
            self.table[key] = self._writing.pop(key)
        if self._writing:
            return False
        for event in self._writing_events:
            event.ack()
        self._writing_events = []
        return True

    def expire(self, now: float, ttl_s: float, owned: Callable[[Any], bool]) -> list:
        """Delete the state of every key this worker ``owned`` that no state change reached for
        ``ttl_s`` (a finished run, a rank that left); return those keys.

        Silence is counted from when this worker last gave the key a state, or first saw it in the
        table (recovered from the changelog), so a key moved between workers gets its full time.
        """
        for key in self._touched:
            self._seen[key] = now
        self._touched.clear()
        expired = []
        for key in self.keys():
            if is_part(key):
                continue  # a piece of a value written in pieces: deleted with its key
            if not owned(key):
                self._seen.pop(key, None)  # another worker's now: it counts the silence
            elif now - self._seen.setdefault(key, now) >= ttl_s:
                expired.append(key)
        for key in expired:
            del self._seen[key]
            self._states.pop(key, None)
            self._writing.pop(key, None)
            if key in self.table:
                del self.table[key]  # a tombstone on the changelog: the next owner does not read it back
        return expired

"""The worker's side of a rank's silence: how long the worker could have heard from it.

A rank is stalled when it has been silent for a bound, but silence counts only while the worker
could hear it: not while the broker is away (``OutageClock.away``), nor while the worker has not
yet processed what the ranks sent (``LagWatch`` says when, ``OutageClock.behind``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


class OutageClock:
    """Wall time with the broker's outages, and the worker's own lag, taken out: the clock stall
    silences are measured on.

    ``away(now)`` (the worker lost the broker) stops it; it runs again ``grace_s`` after
    ``back(now)``. Each rank's shipper finds the returning broker on its own: retries back off up to
    5 s, and a client that failed is replaced, so one rank's spool can arrive at once and another's
    many seconds later (seen on a 3-broker cluster stopped for a minute). Restarting at the first
    message heard judged the later ranks by the first one's return. A rank that is really stuck still
    stalls, only later by the outage's length and the grace.

    ``behind(now)`` (the worker has records it has not processed, written seconds ago: a backlog, or a
    stage waiting behind another's batch) stops it too, and ``caught_up(now)`` starts it again at once:
    until then, what the worker has not read says nothing of the ranks. At 1,024 ranks a worker
    minutes behind raised run-wide stalls whenever the run's progress events waited longer than a
    bound behind telemetry (issue 16, goal 5). A rank stuck meanwhile stalls later by the lag's length.
    """

    def __init__(self, *, grace_s: float = 20.0):
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self.grace_s = grace_s
        self.paused_s = 0.0  # outage time taken out so far
        self.stopped_at: float | None = None  # wall time the clock stopped, while stopped
        self.back_at: float | None = None  # wall time the broker returned, while waiting for a message
        self.lagged_s = 0.0  # time behind taken out so far (on the clock without outages)
        self.behind_at: float | None = None  # when the worker fell behind (same clock), while behind

    def away(self, now: float) -> None:
        if self.stopped_at is None:
            self.stopped_at = now
        self.back_at = None

    def back(self, now: float) -> None:
        if self.stopped_at is not None and self.back_at is None:
            self.back_at = now

    def behind(self, now: float) -> None:
        if self.behind_at is None:
            self.behind_at = self._without_outages(now)

    def caught_up(self, now: float) -> None:
        if self.behind_at is not None:
            self.lagged_s += max(self._without_outages(now) - self.behind_at, 0.0)
            self.behind_at = None

    def read(self, now: float) -> float:
        heard = self._without_outages(now) if self.behind_at is None else self.behind_at
        return heard - self.lagged_s

    def _without_outages(self, now: float) -> float:
        if self.back_at is not None and now >= self.back_at + self.grace_s:
            self._restart(self.back_at + self.grace_s)
        return (now if self.stopped_at is None else self.stopped_at) - self.paused_s

    def _restart(self, at: float) -> None:
        self.paused_s += max(at - self.stopped_at, 0.0)
        self.stopped_at = self.back_at = None


@dataclass
class LagWatch:
    """Whether the worker is behind on its input: some partition it reads holds records past the last
    one processed, and that one was written over ``lag_s`` ago (so the next, unread, is older still).

    Only record times say so: a worker busy on a partition with a backlog processes records all the
    time, and one keeping up with 1,024 ranks always has a few records in flight, read a moment later.
    """

    lag_s: float = 2.0
    _last: dict[Hashable, tuple[int, float]] = field(default_factory=dict)  # partition -> (offset, written at)

    def processed(self, tp: Hashable, offset: int, written_at: float | None, now: float) -> None:
        """A record at ``offset`` of ``tp`` written at ``written_at`` (None or not positive: unknown,
        taken as ``now``) has been processed."""
        self._last[tp] = (offset, written_at if written_at is not None and written_at > 0 else now)

    def behind(self, now: float, ends: Mapping[Hashable, int | None], committed: Mapping[Hashable, int | None]) -> bool:
        """``ends``: each partition read and its end offset as last fetched (None: not known yet);
        ``committed``: the next offset to process of a partition none of whose records this worker
        has processed yet (from then on, lag counts from when it was first asked about)."""
        for tp, end in ends.items():
            if end is None:
                continue
            if tp not in self._last:
                self._last[tp] = ((committed.get(tp) or 0) - 1, now)
            offset, written_at = self._last[tp]
            if end > offset + 1 and now - written_at > self.lag_s:
                return True
        return False

    def forget(self, keep: set) -> None:
        """Drop the partitions not in ``keep`` (no longer assigned)."""
        for tp in [tp for tp in self._last if tp not in keep]:
            del self._last[tp]

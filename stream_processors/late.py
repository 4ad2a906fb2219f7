"""A rank's message that arrives after later ones: rolled up late, not dropped as a replay.

The dedup cursor (``RankState.seq``) drops every message at or below the highest seq applied. That
is right for a replay and wrong for a message that was skipped and comes again later, and Faust
does skip: around a rebalance or the end of table recovery it now and then hands a partition's
later records to a stream and drops earlier ones, which come again only when the partition is read
from its committed offset. Every loss the fault tests traced went so (docs/operations.md): the
skipped records came again and the cursor dropped them. Seqs count from 0 within an incarnation
(docs/contract.md), so a message that jumps the numbering notes the seqs it skipped (``missing``),
and a message with one of them is applied when it comes, if it comes within ``LATE_SEQS`` messages.

A late message goes to the rollups only. Each point joins its window: the open one (sent when it
closes, as any point's), one that closed after the gap opened (kept for this, sent again whole),
or one that never had a point. A point of a window that closed before the gap opened, or was let
go, is dropped as before. Detectors learn a rank's points in step order and do not see late ones;
a non-finite value in them counts in its window's ``nonfinite``.

An earlier incarnation of a rank can trail the next one too: a killed rank's shipper goes on
sending its spool while the restarted rank publishes, and after a broker outage both send at once;
``rankwatch ship`` sends an old spool whenever it is run. Taken for a new incarnation, its messages
would reset the dedup of the running one and feed its detectors older steps, and after a worker's
restart be applied again. So a rank's state keeps the last seq of its ``RETIRED`` latest earlier
incarnations (``retire``): at or below it a message is a replay, above it late, as above. A
producer id never seen is always taken for the newest incarnation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rankwatch.stream_processors.windows import Window

if TYPE_CHECKING:
    from rankwatch.stream_processors.processor import MetricState, RankState

#: How many later messages of its rank a skipped message may trail and still be applied. A replay
#: after a rebalance comes within seconds; at 1 Hz a few seqs, a backlog's catch-up a few hundred.
LATE_SEQS = 256
#: Closed windows a metric keeps while messages are missing, for their points to join.
LATE_WINDOWS = 16
#: Earlier incarnations of a rank whose cursor is kept. A rank restarts a few times in a run at most.
RETIRED = 8


def is_late(state: RankState, producer: str, seq: int) -> bool:
    """Whether ``seq`` is one a later message of this incarnation skipped, still awaited."""
    return producer == state.producer and seq in state.missing


def note_skipped(state: RankState, producer: str, seq: int) -> None:
    """Before ``seq`` is applied as the newest message: note the seqs it skips, forget those too old."""
    fresh = producer != state.producer
    floor = seq - LATE_SEQS
    kept = [] if fresh else [s for s in state.missing if s > floor]
    first = 0 if fresh else state.seq + 1
    opening = not kept
    kept += range(max(first, floor + 1), seq)
    if kept and opening:  # what closes from here on is kept for the missing points
        for ms in state.metrics.values():
            ms.kept_from = ms.window.index if ms.window is not None else 0
    state.missing = kept
    if not kept:
        let_go(state)


def retire(state: RankState) -> None:
    """Before a new incarnation's first message: keep the current one's cursor, for its stragglers."""
    if state.producer:
        state.retired[state.producer] = state.seq
        for producer in list(state.retired)[:-RETIRED]:
            del state.retired[producer]


def found(state: RankState, seq: int) -> None:
    """``seq`` came; with nothing else missing, the kept windows go."""
    state.missing.remove(seq)
    if not state.missing:
        let_go(state)


def let_go(state: RankState) -> None:
    for ms in state.metrics.values():
        if ms.kept_from is not None:
            ms.kept, ms.kept_from = {}, None


def keep(ms: MetricState, closed: list[Window]) -> None:
    """Keep windows that closed while messages are missing (the newest ``LATE_WINDOWS``)."""
    if ms.kept_from is None:
        return
    for w in closed:
        ms.kept[w.index] = w
    while len(ms.kept) > LATE_WINDOWS:
        oldest = min(ms.kept)
        del ms.kept[oldest]
        ms.kept_from = oldest + 1


def roll_late(ms: MetricState, steps: np.ndarray, values: np.ndarray, width: int) -> list[Window]:
    """Add a late message's points to their windows; return the closed windows to send again."""
    resend: dict[int, Window] = {}
    index = steps // width
    for k in np.unique(index).tolist():
        open_ = ms.window
        if open_ is not None and k == open_.index:
            w = open_
        elif (open_ is not None and k > open_.index) or ms.kept_from is None or k < ms.kept_from:
            continue  # ahead of the open window (steps out of seq order), or a window already let go
        else:
            w = resend[k] = ms.kept.setdefault(k, Window(index=k))
        at = index == k
        _add_late(w, steps[at], values[at])
    return list(resend.values())


def _add_late(w: Window, steps: np.ndarray, values: np.ndarray) -> None:
    """``Window.add``, but a window's ``last`` stays the value of its latest step."""
    last, last_step = w.last, w.last_step
    w.add(values, steps)
    if last_step is not None and int(steps.max()) < last_step:
        w.last = last

"""Stage 2 when ranks restart: a new incarnation of a rank (``RankProgress.restarted``) steps anew.

A job that restarts resumes from a checkpoint, often an earlier one: its ranks repeat steps they
had reached. They are stepping (``RunWatcher.observe`` takes their steps as progress), and the
cross-rank rows of those steps count again (``resume``): a straggler on the node the job restarted
on is named while it repeats them, not a checkpoint interval later.

An elastic job can restart with fewer ranks. The ranks beyond its new size are gone, not stalled:
``reform`` stops watching them and resolves their firing conditions, which nothing would judge
again; else a gone rank's stall would page for good.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankwatch.contract import RankProgress

if TYPE_CHECKING:
    from rankwatch.stream_processors.runwatch import RunWatch


def resume(watch: RunWatch, progress: RankProgress) -> None:
    """A restarted rank's steps count in the cross-rank rows from where it resumed."""
    first = min((int(s.steps.min()) for s in progress.series.values() if len(s.steps)), default=progress.last_step)
    for track in watch.tracks.values():
        track.applied.pop(progress.rank, None)
        if first >= 0:  # -1: a first message without points says nothing of where it resumed
            track.scored = min(track.scored, first - 1)


def reform(watch: RunWatch, size: int, *, stall_metric: str, stall_severity: str) -> None:
    """The run restarted with ``size`` ranks: forget the ranks beyond, resolving what fires on them."""
    why = f"the run restarted with {size} ranks"
    for metric, track in watch.tracks.items():
        for rank in [r for r in track.conditions if r >= size]:
            condition = track.conditions.pop(rank)
            if condition.firing:
                severity = track.rule.severity or track.detector.severity
                watch.retired.append((track.detector.name, severity, metric, rank, condition, why))
        for row in track.rows.values():
            for rank in [r for r in row if r >= size]:
                del row[rank]
        _drop(track.applied, size)
    for rank in [r for r in watch.stall_conditions if r is not None and r >= size]:
        condition = watch.stall_conditions.pop(rank)
        if condition.firing:
            watch.retired.append(("stall", stall_severity, stall_metric, rank, condition, why))
    for ranks in (watch.last_step, watch.heard, watch.waits, watch.stepped, watch.partition_of):
        for rank in _drop(ranks, size):
            if watch.stall is not None:
                watch.stall.forget(rank)
    watch.world_size = size


def _drop(by_rank: dict, size: int) -> list[int]:
    gone = [r for r in by_rank if r >= size]
    for rank in gone:
        del by_rank[rank]
    return gone

"""Lag is never an alert (issue 16, goal 5): a worker catching up on a backlog judges ranks by their
own stamps and steps, so it raises no stall and no straggler; a run that really stops still stalls."""

from __future__ import annotations

import numpy as np

from rankwatch.contract import RankProgress, Series
from rankwatch.stream_processors.rules import default_rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher

RANKS = 8


def _progress(rank: int, step: int, rng) -> RankProgress:
    """A healthy rank at ``step``, stamped by itself at t = step (one step a second)."""
    t = float(rng.normal(0.2, 0.001))
    return RankProgress(run="r", rank=rank, world_size=RANKS, last_step=step, ts=float(step),
                        series={"compute_time_s": Series(np.array([step]), np.array([t]))})


def _catch_up(order: list[tuple[int, int]], *, start: float, rate: float) -> tuple[list, RunWatcher, RunWatch]:
    """Apply (rank, step) progress in ``order``, ``rate`` messages per wall second from ``start``,
    with the worker's once-a-second tick; return the alerts."""
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    rng = np.random.default_rng(0)
    alerts, next_tick = [], start
    for i, (rank, step) in enumerate(order):
        now = start + i / rate
        while next_tick <= now:
            alerts += watcher.tick(watch, next_tick)
            next_tick += 1.0
        alerts += watcher.observe(watch, _progress(rank, step, rng), now)
    return alerts, watcher, watch


def test_a_backlog_read_in_a_burst_raises_no_stall_and_no_straggler():
    # Two minutes of a healthy run, read 5 minutes late at 40 messages a second; the partitions of
    # ranks 0-3 are read to the end before those of ranks 4-7 (the most uneven lag there is).
    steps = range(120)
    order = [(r, s) for half in (range(4), range(4, 8)) for s in steps for r in half]
    alerts, _, _ = _catch_up(order, start=420.0, rate=40.0)
    assert alerts == []


def test_a_backlog_read_evenly_raises_nothing_and_a_stop_after_it_is_still_a_stall():
    order = [(r, s) for s in range(120) for r in range(RANKS)]
    alerts, watcher, watch = _catch_up(order, start=300.0, rate=40.0)
    assert alerts == []
    # Caught up (the last message arrived at 324 s); now the job stops for real.
    end = 300.0 + len(order) / 40.0
    fired = [a for t in np.arange(end, end + 60.0) for a in watcher.tick(watch, float(t))]
    assert [(a.detector, a.rank, a.status) for a in fired] == [("stall", None, "firing")], fired

"""Lag is never an alert (issue 16, goal 5): a worker catching up on a backlog judges ranks by their
own stamps and steps, so it raises no stall and no straggler; a run that really stops still stalls."""

from __future__ import annotations

import numpy as np

from rankwatch.contract import RankProgress, Series
from rankwatch.stream_processors.rules import default_rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher

RANKS = 8


def _progress(rank: int, step: int, rng, partition: int = -1) -> RankProgress:
    """A healthy rank at ``step``, stamped by itself at t = step (one step a second)."""
    t = float(rng.normal(0.2, 0.001))
    return RankProgress(run="r", rank=rank, world_size=RANKS, last_step=step, ts=float(step),
                        series={"compute_time_s": Series(np.array([step]), np.array([t]))}, partition=partition)


def _catch_up(order: list[tuple[int, int]], *, start: float, rate: float,
              partitions: int = 0) -> tuple[list, RunWatcher, RunWatch]:
    """Apply (rank, step) progress in ``order``, ``rate`` messages per wall second from ``start``,
    with the worker's once-a-second tick; return the alerts. With ``partitions``, rank r's messages
    come on telemetry partition r // (RANKS // partitions)."""
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    rng = np.random.default_rng(0)
    alerts, next_tick = [], start
    for i, (rank, step) in enumerate(order):
        now = start + i / rate
        while next_tick <= now:
            alerts += watcher.tick(watch, next_tick)
            next_tick += 1.0
        partition = rank // (RANKS // partitions) if partitions else -1
        alerts += watcher.observe(watch, _progress(rank, step, rng, partition), now)
    return alerts, watcher, watch


def test_a_partition_read_long_after_the_others_raises_no_stall_on_its_ranks():
    # Seen at 1,024 ranks on one worker far behind (bench/scale_latency.py: 195 false stalls): all
    # ranks were read in step for a while, then the worker read one partition 24 s (wall) ahead of
    # the other, so ranks 4-7 had nothing new for longer than a stall bound, by the clock and by their
    # peers' stamps. Their partition-mates are no further on: they are late, not stalled.
    steps_in_step = [(r, s) for s in range(30) for r in range(RANKS)]
    first_half = [(r, s) for s in range(30, 150) for r in range(4)]
    second_half = [(r, s) for s in range(30, 150) for r in range(4, 8)]
    alerts, _, _ = _catch_up(steps_in_step + first_half + second_half, start=400.0, rate=20.0, partitions=2)
    assert alerts == []


def test_a_rank_that_stops_while_its_partition_mates_go_on_is_still_a_stall():
    order = [(r, s) for s in range(30) for r in range(RANKS)]
    order += [(r, s) for s in range(30, 60) for r in range(RANKS) if r != 5]  # rank 5 stops at step 29
    alerts, _, _ = _catch_up(order, start=30.0, rate=float(RANKS), partitions=2)  # read in real time
    assert [(a.detector, a.rank, a.status) for a in alerts] == [("stall", 5, "firing")], alerts


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

"""Lag is never an alert (issue 16, goal 5): a worker catching up on a backlog judges ranks by their
own stamps and steps, so it raises no stall and no straggler; a run that really stops still stalls."""

from __future__ import annotations

import numpy as np

from rankwatch.contract import RankProgress, Series
from rankwatch.stream_processors.clocks import LagWatch
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


def test_a_worker_behind_its_own_stage_raises_no_run_wide_stall_while_its_clock_is_stopped():
    # Seen at 1,024 ranks on one worker minutes behind: six run-wide stalls of a healthy run. Run
    # events waited behind telemetry, so stage 2 heard nothing for longer than a bound; the worker
    # had unread records all along, written long before. Its clock stops meanwhile.
    def run(stop_clock: bool) -> list:
        watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
        rng = np.random.default_rng(0)
        alerts = []
        for step in range(60):  # read in real time: the pace is learned
            for rank in range(RANKS):
                alerts += watcher.observe(watch, _progress(rank, step, rng), step + 0.5)
            alerts += watcher.tick(watch, step + 1.0)
        if stop_clock:
            watcher.outages.behind(61.0)
        for t in range(61, 91):  # 30 s with no run event processed: they wait behind telemetry
            alerts += watcher.tick(watch, float(t))
        watcher.outages.caught_up(91.0)
        for step in range(60, 90):  # then they come, late, and the worker catches up
            for rank in range(RANKS):
                alerts += watcher.observe(watch, _progress(rank, step, rng), 91.0)
        alerts += watcher.tick(watch, 92.0)
        return alerts

    assert [(a.detector, a.rank, a.status) for a in run(stop_clock=False)][:1] == [("stall", None, "firing")]
    assert run(stop_clock=True) == []


def test_the_lag_watch_says_behind_only_when_unread_records_were_written_over_its_lag_ago():
    lags = LagWatch(lag_s=2.0)
    lags.processed("t0", offset=99, written_at=100.0, now=100.5)
    assert not lags.behind(101.0, {"t0": 100}, {})  # read to the end
    assert not lags.behind(101.0, {"t0": 150}, {})  # unread, but written after 100: under 2 s behind
    assert lags.behind(103.0, {"t0": 150}, {})
    lags.processed("t0", offset=149, written_at=102.5, now=103.2)
    assert not lags.behind(103.5, {"t0": 150}, {})
    assert not lags.behind(103.5, {"t0": None}, {})  # end not known yet
    # A partition none of whose records it processed yet counts from when it was first asked about.
    assert not lags.behind(200.0, {"t1": 10}, {"t1": 10})  # nothing past its commit
    assert not lags.behind(200.0, {"t2": 10}, {"t2": 4})
    assert lags.behind(202.5, {"t2": 10}, {"t2": 4})
    lags.forget({"t0"})  # t2 was revoked: a later assignment counts from when it is asked about again
    assert not lags.behind(203.0, {"t2": 10}, {"t2": 4})

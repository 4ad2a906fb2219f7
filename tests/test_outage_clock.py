"""An outage of the broker is no stall: the OutageClock and the RunWatcher that measures silences on it."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.contract import RankProgress
from rankwatch.stream_processors.clocks import OutageClock
from rankwatch.stream_processors.rules import default_rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher


def _step(rank: int, step: int) -> RankProgress:
    return RankProgress(run="r", rank=rank, world_size=2, last_step=step, ts=float(step), series={})


def _paced_run(watcher: RunWatcher, watch: RunWatch, steps: range) -> list:
    """Two ranks stepping once a second (wall time = step), long enough to learn the pace."""
    return [a for s in steps for r in (0, 1) for a in watcher.observe(watch, _step(r, s), now=float(s))]


def test_the_clock_stops_while_away_and_runs_again_a_grace_after_the_broker_is_back():
    clock = OutageClock(grace_s=10.0)
    assert clock.read(5.0) == 5.0
    clock.away(10.0)
    assert clock.read(40.0) == 10.0
    clock.back(40.0)
    assert clock.read(43.0) == 10.0  # back, but the ranks' shippers are still finding it
    assert clock.read(50.0) == 10.0
    assert clock.read(55.0) == 15.0  # it runs from back + grace (50)
    clock.away(60.0)
    clock.away(61.0)  # still away: the first stop counts
    clock.back(62.0)
    assert clock.read(80.0) == 20.0 + 8.0  # stopped at 20, runs again from 72
    with pytest.raises(ValueError):
        OutageClock(grace_s=-1.0)


def test_the_clock_stops_while_the_worker_is_behind_and_runs_again_at_once_when_caught_up():
    clock = OutageClock(grace_s=10.0)
    clock.behind(10.0)
    clock.behind(12.0)  # still behind: the first stop counts
    assert clock.read(30.0) == 10.0
    clock.caught_up(30.0)
    assert clock.read(31.0) == 11.0  # no grace: it has read all there is
    clock.caught_up(32.0)  # caught up already: nothing changes
    assert clock.read(32.0) == 12.0
    # Behind during an outage: neither stretch is counted twice.
    clock.away(40.0)  # 20 on the clock
    clock.behind(45.0)
    clock.back(50.0)
    clock.caught_up(70.0)  # the outage's grace ended at 60
    assert clock.read(80.0) == 20.0 + 10.0


def test_one_rank_s_backlog_arriving_first_after_an_outage_is_no_stall_of_the_others():
    """Each rank's shipper finds the returning broker on its own: here rank 0's spooled steps, to the
    run's end, arrive at once and rank 1's fifteen seconds later."""
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    assert _paced_run(watcher, watch, range(40)) == []
    watcher.outages.away(40.5)
    assert [a for t in range(41, 80) for a in watcher.tick(watch, float(t))] == []
    watcher.outages.back(80.0)
    early = [a for s in range(40, 100) for a in watcher.observe(watch, _step(0, s), now=81.0)]
    early += watcher.observe(watch, RankProgress(run="r", rank=0, world_size=2, last_step=99, ts=99.0, series={},
                                                 final=True), now=81.0)
    waiting = [a for t in np.arange(81, 96, 0.5) for a in watcher.tick(watch, float(t))]
    late = [a for s in range(40, 100) for a in watcher.observe(watch, _step(1, s), now=96.0)]
    late += watcher.observe(watch, RankProgress(run="r", rank=1, world_size=2, last_step=99, ts=99.0, series={},
                                                final=True), now=96.0)
    after = [a for t in np.arange(96, 130, 0.5) for a in watcher.tick(watch, float(t))]
    assert early + waiting + late + after == [], early + waiting + late + after


def test_a_broker_outage_raises_no_stall_and_a_real_stall_after_it_still_fires():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    assert _paced_run(watcher, watch, range(40)) == []
    watcher.outages.away(40.5)  # the broker goes at t=40; the worker's watch notices half a second later
    quiet = [a for t in range(41, 80) for a in watcher.tick(watch, float(t))]
    assert quiet == [], quiet  # 39 s without a step, all of it while the broker was away
    watcher.outages.back(80.0)
    # The ranks trained on meanwhile: their spooled steps, stamped by the ranks, arrive in a burst two
    # seconds after the broker, and the run goes on.
    assert [a for s in range(40, 82) for r in (0, 1) for a in watcher.observe(watch, _step(r, s), now=82.0)] == []
    assert _paced_run(watcher, watch, range(82, 100)) == []
    assert [a for t in np.arange(100, 105, 0.5) for a in watcher.tick(watch, float(t))] == []
    # Now the job really stops, with the broker up: a stall, as before.
    fired = [a for t in range(100, 140) for a in watcher.tick(watch, float(t))]
    assert [(a.rank, a.status, a.metric) for a in fired] == [(None, "firing", "steps")], fired


def test_without_the_outage_clock_stopping_the_same_silence_is_a_stall():
    # The control: what the first test would see if the worker had not noticed the broker was away.
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    _paced_run(watcher, watch, range(40))
    fired = [a for t in range(41, 80) for a in watcher.tick(watch, float(t))]
    assert [(a.rank, a.status) for a in fired] == [(None, "firing")], fired

"""A run's cross-rank and stall watch survives a move between workers: stored as a versioned record,
read back by the next owner, and deaf to the replays at-least-once delivery brings (issue 16, goal 4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from faust.serializers import codecs

from rankwatch.contract import Alert, RankProgress, Series
from rankwatch.stream_processors.clocks import OutageClock
from rankwatch.stream_processors.policies import Condition
from rankwatch.stream_processors.rules import Rules, default_rules
from rankwatch.stream_processors.runwatch import WATCH_VERSION, RunWatch, RunWatcher, WatchStateError
from rankwatch.stream_processors.tables import MAX_RECORD_BYTES, STATE_CODEC


def _progress(rank: int, step: int, world: int, t: float) -> RankProgress:
    series = {"compute_time_s": Series(np.array([step]), np.array([t]))}
    return RankProgress(run="r", rank=rank, world_size=world, last_step=step, ts=float(step), series=series)


def _stream(steps: range, world: int = 4) -> list[RankProgress]:
    """Rank 2 straggles from step 40; one progress per rank per step, stamped one step a second."""
    rng = np.random.default_rng(1)
    return [_progress(rank, step, world, 1.0 + 0.01 * rng.standard_normal() + (0.5 if rank == 2 and step >= 40 else 0))
            for step in steps for rank in range(world)]


def _identities(alerts) -> list[tuple]:
    return [(a.key, a.status, a.incident, a.ranks) for a in alerts]


CODEC = codecs.get_codec(STATE_CODEC)


def _stored(watch: RunWatch) -> dict:
    """What the changelog holds: the watch through the tables' codec."""
    return CODEC.loads(CODEC.dumps(watch))


def _moved(watch: RunWatch, *, clock: float) -> RunWatch:
    """What the next owner reads."""
    return RunWatch.from_dict(_stored(watch), rules=default_rules(), clock=clock)


def test_a_watch_moved_mid_run_raises_the_alerts_an_unmoved_one_does():
    stream = _stream(range(80))
    watcher = RunWatcher(rules=default_rules(), outages=OutageClock())
    one = RunWatch(run="r")
    expected = [a for p in stream for a in watcher.observe(one, p, now=p.ts)]
    assert any(a.status == "firing" and a.rank == 2 for a in expected)  # the straggler was caught

    first, rest = stream[: 30 * 4], stream[30 * 4 :]  # moved after warm-up, before the straggler
    a_watcher = RunWatcher(rules=default_rules(), outages=OutageClock())
    watch = RunWatch(run="r")
    got = [a for p in first for a in a_watcher.observe(watch, p, now=p.ts)]
    b_watcher = RunWatcher(rules=default_rules(), outages=OutageClock())  # the other worker
    moved = _moved(watch, clock=b_watcher.outages.read(60.0))
    got += [a for p in rest for a in b_watcher.observe(moved, p, now=p.ts)]
    assert _identities(got) == _identities(expected)


def test_replayed_progress_changes_nothing():
    stream = _stream(range(60))
    watcher = RunWatcher(rules=default_rules(), outages=OutageClock())
    watch = RunWatch(run="r")
    for p in stream:
        watcher.observe(watch, p, now=p.ts)
    before = _stored(watch)
    assert before["tracks"]  # the cross-rank tracks are compared too
    replays = [a for p in stream[-20:] for a in watcher.observe(watch, p, now=59.0)]
    assert replays == [] and _stored(watch) == before


def test_time_between_owners_is_not_silence():
    watcher = RunWatcher(rules=default_rules(), outages=OutageClock())
    watch = RunWatch(run="r")
    for p in _stream(range(30)):
        watcher.observe(watch, p, now=1000.0 + p.ts)
    # The next owner reads it 20 s later (session timeout, join, recovery): the run's own silence is 0.
    moved = _moved(watch, clock=1049.0)
    assert moved.event_now(1049.0) == watch.event_now(1029.0) == pytest.approx(29.0)
    assert watcher.tick(moved, now=1049.0) == []


def test_an_unknown_version_is_refused_with_a_clear_error():
    stored = RunWatch(run="r").to_dict()
    assert stored["version"] == WATCH_VERSION
    with pytest.raises(WatchStateError, match=rf"version 99.*reads version {WATCH_VERSION}"):
        RunWatch.from_dict({**stored, "version": 99}, rules=default_rules(), clock=0.0)
    with pytest.raises(WatchStateError, match="version None"):
        RunWatch.from_dict({"run": "r"}, rules=default_rules(), clock=0.0)


def test_a_detector_field_this_worker_lacks_is_refused_not_misread():
    watcher, watch = RunWatcher(rules=default_rules(), outages=OutageClock()), RunWatch(run="r")
    for p in _stream(range(20)):
        watcher.observe(watch, p, now=p.ts)
    stored = _stored(watch)
    stored["tracks"]["compute_time_s"]["detector"]["learned_later"] = 1.0  # a newer release's state
    with pytest.raises(WatchStateError, match="does not fit this worker: TypeError.*learned_later"):
        RunWatch.from_dict(stored, rules=default_rules(), clock=0.0)


def test_a_large_runs_watch_stores_its_learning_not_its_waiting_rows():
    """4,096 ranks, each sending 64 steps a message in rank order (as a worker reading partitions
    in turn sees them): rows wait for ranks not read yet. When the stored watch held those rows it
    passed 1 MB at 128 ranks (issue 16); its size now grows with the ranks, not with the rows."""
    world, names = 4096, ("compute_time_s", "data_wait_s", "loss")
    rng = np.random.default_rng(3)
    watcher = RunWatcher(rules=default_rules(), outages=OutageClock())
    watch = RunWatch(run="r")
    largest = 0
    for message in range(2):
        steps = np.arange(message * 64, (message + 1) * 64)
        for rank in range(world):
            series = {name: Series(steps, 1.0 + 0.01 * rng.standard_normal(64)) for name in names}
            watcher.observe(watch, RankProgress(run="r", rank=rank, world_size=world, last_step=int(steps[-1]),
                                                ts=float(message), series=series), now=float(message))
            if rank % 512 == 511:
                largest = max(largest, len(CODEC.dumps(watch)))
    assert set(watch.tracks) == set(names)
    assert 100_000 < largest < MAX_RECORD_BYTES  # per-rank baselines of 4,096 ranks, and no rows
    # Each step is learned once: a rank's value for a step already scored does not open it again.
    assert all(0 < track.detector.steps <= 128 for track in watch.tracks.values())


def test_a_firing_alert_whose_rule_is_gone_from_the_next_owners_rules_is_resolved_once():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    fired = []
    for i, progress in enumerate(_stream(range(60))):
        fired += watcher.observe(watch, progress, now=float(i // 4))
    assert [(a.rank, a.status) for a in fired] == [(2, "firing")]  # rank 2 straggles from step 40
    watch.stall_conditions[None] = Condition(firing=True, incident=55)  # and, say, a run-wide stall
    # The next owner runs rules with neither the compute-time straggler rule nor the stall rule.
    rules = default_rules()
    kept = Rules(tuple(r for r in rules.rules if r.detector != "stall" and "compute_time_s" not in r.metrics),
                 rules.group_wait_s)
    moved = RunWatch.from_dict(_stored(watch), rules=kept, clock=100.0)
    assert "compute_time_s" not in moved.tracks and moved.stall_conditions == {}
    resolved = RunWatcher(rules=kept).tick(moved, now=100.0)
    assert sorted((a.detector, a.rank, a.status, a.incident) for a in resolved) == [
        ("crossrank", 2, "resolved", fired[0].incident), ("stall", None, "resolved", 55)]
    assert {a.key for a in resolved} == {fired[0].key, Alert.make_key("r", "stall", "steps", None)}
    assert all("rule was removed" in a.message for a in resolved)
    assert RunWatcher(rules=kept).tick(moved, now=101.0) == []  # once
    assert RunWatch.from_dict(_stored(moved), rules=kept, clock=102.0).retired == []  # and not stored


def test_a_rule_edited_since_the_watch_was_stored_rebuilds_its_detector_and_an_unedited_one_keeps_learning():
    watcher, watch = RunWatcher(rules=default_rules()), RunWatch(run="r")
    for i, progress in enumerate(_stream(range(30))):
        watcher.observe(watch, progress, now=float(i // 4))
    learned = watch.tracks["compute_time_s"].detector.steps
    assert learned > 0 and _moved(watch, clock=10.0).tracks["compute_time_s"].detector.steps == learned
    rules = default_rules()
    edited = Rules(tuple(dataclasses.replace(r, params={**r.params, "persist": 3}) if "compute_time_s" in r.metrics
                         else dataclasses.replace(r, params={"factor": 7.0}) if r.detector == "stall"
                         else r for r in rules.rules), rules.group_wait_s)
    assert watch.stall.state_dict()["history"] and _moved(watch, clock=10.0).stall.state_dict()["history"]
    moved = RunWatch.from_dict(_stored(watch), rules=edited, clock=10.0)
    detector = moved.tracks["compute_time_s"].detector
    assert (detector.persist, detector.steps) == (3, 0)
    assert (moved.stall.factor, moved.stall.state_dict()["history"]) == (7.0, [])

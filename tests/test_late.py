"""A rank's message skipped and delivered again after later ones is rolled up late, not dropped."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from rankwatch.contract import RUN_EVENTS, ProgressBatch, RankProgress, Series, TelemetryBatch, decode_run_event
from rankwatch.stream_processors.batching import process_batch
from rankwatch.stream_processors.late import LATE_SEQS, LATE_WINDOWS, RETIRED
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor


def _stream(n: int, per: int, *, seed: int = 0, producer: str = "p1") -> list[TelemetryBatch]:
    rng = np.random.default_rng(seed)
    values = 2.0 + rng.normal(0.0, 0.01, n * per)
    return [TelemetryBatch(run="r", rank=3, world_size=4, producer=producer, seq=i, ts=100.0 + i,
                           series={"loss": Series(np.arange(i * per, (i + 1) * per, dtype=np.int64),
                                                  values[i * per:(i + 1) * per])})
            for i in range(n)]


def _rollups(proc: TelemetryProcessor, state: RankState, batches, order) -> dict[int, dict]:
    """The rollups sent for ``batches`` delivered in ``order``: the last one sent per window wins."""
    sent = {}
    for i in order:
        for r in proc.process(state, batches[i], now=0.0).rollups:
            sent[r.start_step] = json.loads(r.to_bytes())
    return sent


def _progress(messages) -> list[RankProgress]:
    """The rank progress among stage 1's ``messages``, in order."""
    events = [decode_run_event(value) for topic, _, value in messages if topic == RUN_EVENTS]
    return [p for e in events if not hasattr(e, "alert") for p in (e.items if isinstance(e, ProgressBatch) else [e])]


def _same(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert a.keys() == b.keys()
    for start in a:
        for name in ("count", "nonfinite", "first_step", "last_step", "last", "min", "max"):
            assert a[start][name] == b[start][name], (start, name)
        for name in ("mean", "std", "p50", "p95"):
            assert math.isclose(a[start][name], b[start][name], rel_tol=1e-9), (start, name)


def test_a_skipped_message_delivered_after_later_ones_gives_the_rollups_of_an_ordered_run():
    proc = TelemetryProcessor(rollup_steps=50)
    batches = _stream(7, 20)  # seq 2 holds steps 40-59: the end of window 0 and the start of window 1
    ordered = _rollups(proc, RankState(), batches, range(7))
    state = RankState()
    late = _rollups(proc, state, batches, [0, 1, 3, 4, 2, 5, 6])
    _same(late, ordered)
    assert state.missing == [] and state.metrics["loss"].kept == {}  # nothing kept once nothing is missing
    # Delivered once more, it is a replay again.
    assert proc.process(state, batches[2], now=0.0).rollups == []


def test_a_new_ranks_first_message_after_its_second_still_rolls_up():
    # The start-up case: a worker's first message of a rank is seq 1; seq 0 comes when the partition
    # is read again from its committed offset.
    proc = TelemetryProcessor(rollup_steps=10)
    batches = _stream(4, 10)
    state = RankState()
    assert proc.process(state, batches[1], now=0.0).rollups == [] and state.missing == [0]
    out = proc.process(state, batches[0], now=0.0)
    assert out.arrived_late and out.alerts == [] and out.last_step is None
    assert [(r.start_step, r.count) for r in out.rollups] == [(0, 10)]
    rest = _rollups(proc, state, batches, [2, 3])
    assert [(s, r["count"]) for s, r in rest.items()] == [(10, 10), (20, 10)]


def test_a_late_message_teaches_the_detectors_nothing():
    proc = TelemetryProcessor(rollup_steps=50)
    batches = _stream(4, 20, seed=1)
    state = RankState()
    for i in (0, 1, 3):
        proc.process(state, batches[i], now=0.0)
    detectors = json.dumps(state.metrics["loss"].to_dict()["detectors"], sort_keys=True)
    proc.process(state, batches[2], now=0.0)
    assert json.dumps(state.metrics["loss"].to_dict()["detectors"], sort_keys=True) == detectors


def test_a_message_more_than_late_seqs_behind_is_dropped_and_nothing_stays_kept():
    proc = TelemetryProcessor(rollup_steps=10)
    batches = _stream(LATE_SEQS + 3, 1)
    state = RankState()
    for i in [0, *range(2, LATE_SEQS + 3)]:  # seq 1 skipped, then more than LATE_SEQS later ones
        proc.process(state, batches[i], now=0.0)
    assert state.missing == [] and state.metrics["loss"].kept_from is None
    assert proc.is_replay(state, batches[1])
    assert proc.process(state, batches[1], now=0.0).rollups == []


def test_at_most_late_windows_are_kept_and_older_points_are_dropped():
    proc = TelemetryProcessor(rollup_steps=10)
    n = LATE_WINDOWS + 4
    batches = _stream(n, 10)
    state = RankState()
    _rollups(proc, state, batches, [0, *range(2, n)])  # seq 1 (window 1) missing while n-2 windows close
    ms = state.metrics["loss"]
    assert len(ms.kept) == LATE_WINDOWS and ms.kept_from == min(ms.kept) > 1
    out = proc.process(state, batches[1], now=0.0)
    assert out.arrived_late and out.rollups == []  # its window was let go: dropped, as before
    assert state.missing == [] and ms.kept == {}


def test_what_is_missing_and_kept_survives_a_round_trip_and_is_absent_when_nothing_is():
    proc = TelemetryProcessor(rollup_steps=50)
    batches = _stream(5, 20, seed=2)
    plain = RankState()
    proc.process(plain, batches[0], now=0.0)
    assert "missing" not in plain.to_dict() and "kept" not in plain.to_dict()["metrics"]["loss"]
    state = RankState()
    for i in (0, 1, 3):
        proc.process(state, batches[i], now=0.0)
    stored = json.loads(json.dumps(state.to_dict()))
    assert stored["missing"] == [2] and [w["index"] for w in stored["metrics"]["loss"]["kept"]] == [0]
    back = RankState.from_dict(stored)
    assert _rollups(proc, back, batches, [2, 4]) == _rollups(proc, state, batches, [2, 4])


def test_a_restarted_rank_forgets_what_its_last_incarnation_missed():
    proc = TelemetryProcessor(rollup_steps=10)
    state = RankState()
    first = _stream(3, 10)
    proc.process(state, first[0], now=0.0)
    proc.process(state, first[2], now=0.0)
    assert state.missing == [1]
    proc.process(state, _stream(1, 10, producer="p2")[0], now=0.0)
    assert state.missing == [] and state.metrics["loss"].kept_from is None


def test_process_batch_reports_the_messages_applied_late():
    proc = TelemetryProcessor(rollup_steps=10)
    batches = _stream(3, 10)
    out = process_batch(proc, [batches[i] for i in (1, 2, 0, 0)], lambda key: None, now=0.0)
    assert out.late == [(batches[0].key.decode(), 0)] and out.applied == 3


def _restarted(batches: list[TelemetryBatch], at: int) -> list[TelemetryBatch]:
    """``batches`` from a rank whose publisher restarted before message ``at``: incarnation "b",
    numbering from 0 again, carries on where "a" stopped."""
    return [dataclasses.replace(b, producer="a", seq=i) if i < at else
            dataclasses.replace(b, producer="b", seq=i - at) for i, b in enumerate(batches)]


def test_an_earlier_incarnations_message_after_the_next_began_is_rolled_up_late_and_changes_nothing_else():
    # A killed rank's shipper still sending its spool while the restarted rank publishes.
    proc = TelemetryProcessor(rollup_steps=50)
    batches = _restarted(_stream(6, 10, seed=3), at=4)
    ordered = _rollups(proc, RankState(), batches, range(6))
    state = RankState()
    _rollups(proc, state, batches, [0, 1, 2, 4])  # a3 (steps 30-39) trails b0 (40-49)
    detectors = json.dumps(state.metrics["loss"].to_dict()["detectors"], sort_keys=True)
    out = proc.process(state, batches[3], now=0.0)
    assert out.arrived_late and out.alerts == [] and out.last_step is None
    assert (state.producer, state.seq, state.retired) == ("b", 0, {"a": 3})
    assert json.dumps(state.metrics["loss"].to_dict()["detectors"], sort_keys=True) == detectors
    rest = _rollups(proc, state, batches, [5])  # b1 closes window 0, with a3's points in it
    assert state.missing == []  # b carries on as the current incarnation: nothing of it awaited
    _same(rest, {0: ordered[0]})


def test_an_earlier_incarnations_replay_after_the_next_began_is_dropped():
    # A worker restarted after the rank did reads both incarnations again from its committed offset.
    proc = TelemetryProcessor(rollup_steps=10)
    batches = _restarted(_stream(6, 10, seed=4), at=3)
    state = RankState()
    sent = _rollups(proc, state, batches, range(6))
    before = json.dumps(state.to_dict(), sort_keys=True)
    for i in (1, 2, 4):
        assert proc.is_replay(state, batches[i])
        assert proc.process(state, batches[i], now=0.0).rollups == []
    assert json.dumps(state.to_dict(), sort_keys=True) == before
    assert sorted(sent) == [0, 10, 20, 30, 40]


def test_the_retired_incarnations_survive_a_round_trip_and_only_the_latest_are_kept():
    proc = TelemetryProcessor(rollup_steps=10)
    state = RankState()
    proc.process(state, _stream(1, 10)[0], now=0.0)
    assert "retired" not in state.to_dict()
    for n in range(RETIRED + 2):
        proc.process(state, dataclasses.replace(_stream(1, 10)[0], producer=f"q{n}", seq=n), now=0.0)
    back = RankState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back.retired == state.retired and len(back.retired) == RETIRED
    # p1 and q0, retired first, went; q{RETIRED + 1} is the current one
    assert list(back.retired) == [f"q{n}" for n in range(1, RETIRED + 1)]
    assert back.retired["q8"] == 8 and back.producer == f"q{RETIRED + 1}"


def test_an_earlier_incarnations_final_message_does_not_close_the_rank():
    proc = TelemetryProcessor(rollup_steps=10)
    batches = _restarted(_stream(3, 10), at=1)
    closing = dataclasses.replace(_stream(2, 10)[1], producer="a", seq=1, final=True)
    out = process_batch(proc, [batches[0], batches[1], closing], lambda key: None, now=0.0)
    progress = _progress(out.messages)
    assert [(p.last_step, p.final) for p in progress] == [(9, False), (19, False)]
    assert out.late == [(batches[0].key.decode(), 1)]


def test_a_new_incarnations_first_progress_says_the_rank_restarted():
    # Stage 2 then takes its steps as progress even below the old ones (resumed from a checkpoint).
    proc = TelemetryProcessor(rollup_steps=10)
    a, b = _stream(3, 10), _stream(3, 10, producer="p2")
    out = process_batch(proc, [a[0], a[1], b[0], b[1]], lambda key: None, now=0.0)
    progress = _progress(out.messages)
    assert [(p.last_step, p.restarted) for p in progress] == [(9, False), (19, False), (9, True), (19, False)]
    # With no points, the first message still says so.
    empty = dataclasses.replace(a[2], producer="p3", seq=0, series={})
    [item] = _progress(process_batch(proc, [empty], lambda key: out.states[key], now=0.0).messages)
    assert (item.last_step, item.restarted) == (-1, True)


def _incarnation(producer: str, first_step: int, last_step: int, value: float) -> list[TelemetryBatch]:
    """One incarnation's messages of ten steps each, every value ``value``."""
    return [TelemetryBatch(run="r", rank=3, world_size=4, producer=producer, seq=seq, ts=100.0 + step,
                           series={"loss": Series(np.arange(step, step + 10), np.full(10, value))})
            for seq, step in enumerate(range(first_step, last_step + 1, 10))]


def test_a_rank_resumed_from_an_earlier_checkpoint_rolls_up_the_steps_it_repeats_afresh():
    proc = TelemetryProcessor(rollup_steps=50)
    first, resumed = _incarnation("a", 0, 119, 1.0), _incarnation("b", 60, 159, 2.0)
    state = RankState()
    sent = [json.loads(r.to_bytes()) for b in first + resumed for r in proc.process(state, b, now=0.0).rollups]
    as_sent = [(r["start_step"], r["first_step"], r["count"], r["mean"]) for r in sent]
    # a's window 100 as it stood, then b's windows: 60-99 of window 50 (the store keeps the last per
    # window), then 100-149 whole. Before: b's steps 60-99 were dropped and window 100 had 70 points.
    assert as_sent == [(0, 0, 50, 1.0), (50, 50, 50, 1.0), (100, 100, 20, 1.0), (50, 60, 40, 2.0), (100, 100, 50, 2.0)]
    assert state.resuming == set()


def test_a_rank_restarted_where_it_stopped_keeps_its_open_windows():
    proc = TelemetryProcessor(rollup_steps=50)
    state = RankState()
    sent = [json.loads(r.to_bytes()) for b in _incarnation("a", 0, 119, 1.0) + _incarnation("b", 120, 159, 2.0)
            for r in proc.process(state, b, now=0.0).rollups]
    assert [(r["start_step"], r["count"], r["mean"]) for r in sent] == [(0, 50, 1.0), (50, 50, 1.0), (100, 50, 1.6)]


def test_a_restarted_ranks_metrics_not_seen_again_yet_survive_a_round_trip():
    proc = TelemetryProcessor(rollup_steps=50)
    state = RankState()
    proc.process(state, _incarnation("a", 0, 9, 1.0)[0], now=0.0)
    eval_point = TelemetryBatch(run="r", rank=3, world_size=4, producer="a", seq=1, ts=0.0,
                                series={"eval_acc": Series(np.array([9]), np.array([0.5]))})
    proc.process(state, eval_point, now=0.0)
    assert "resuming" not in state.to_dict()
    proc.process(state, _incarnation("b", 5, 14, 1.0)[0], now=0.0)
    back = RankState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back.resuming == {"eval_acc"}  # its first point since the restart may go back still

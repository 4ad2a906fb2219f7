"""A rank's restarts: a new publisher incarnation (``producer``) is progress even when it resumes
from an earlier checkpoint, and an earlier incarnation's messages that trail it change nothing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from test_late import _rollups, _same, _stream

from rankwatch.contract import RUN_EVENTS, ProgressBatch, RankProgress, Series, TelemetryBatch, decode_run_event
from rankwatch.stream_processors.batching import process_batch
from rankwatch.stream_processors.late import RETIRED
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor


def _progress(messages) -> list[RankProgress]:
    """The rank progress among stage 1's ``messages``, in order."""
    events = [decode_run_event(value) for topic, _, value in messages if topic == RUN_EVENTS]
    return [p for e in events if isinstance(e, (RankProgress, ProgressBatch))
            for p in (e.items if isinstance(e, ProgressBatch) else [e])]


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


def _training(proc: TelemetryProcessor, state: RankState, producer: str, steps, loss, *, seed: int) -> list:
    """One incarnation stepping once a message: its alerts, as (detector, metric, status, step)."""
    rng = np.random.default_rng(seed)
    alerts = []
    for seq, step in enumerate(steps):
        series = {"loss": Series(np.array([step]), np.array([loss(step)])),
                  "grad_norm": Series(np.array([step]), np.array([1.0 + rng.normal(0.0, 0.05)]))}
        batch = TelemetryBatch(run="r", rank=0, world_size=1, producer=producer, seq=seq, ts=float(step), series=series)
        alerts += [(a.detector, a.metric, a.status, a.step) for a in proc.process(state, batch, now=float(step)).alerts]
    return alerts


def test_a_rank_resumed_from_an_earlier_checkpoint_is_no_loss_spike_and_a_resume_that_breaks_still_alerts():
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 0.01, 400)

    def loss(step: int) -> float:  # falling: at the checkpoint of step 150 it was higher than at 249
        return 3.0 * np.exp(-step / 200) + 0.5 + noise[step]

    proc, state = TelemetryProcessor(rollup_steps=50), RankState()
    assert _training(proc, state, "a", range(250), loss, seed=1) == []
    # Before, the loss going back up from 1.36 to 1.91 was a spike alert at step 150.
    assert _training(proc, state, "b", range(150, 300), loss, seed=2) == []
    # A NaN at the resume's first point, an explosion at its third: caught where they happen.
    broken = _training(proc, state, "c", range(200, 204),
                       lambda step: {200: np.nan, 202: 1e6}.get(step, loss(step)), seed=3)
    assert [(d, status, step) for d, m, status, step in broken if m == "loss" and status == "firing"] == [
        ("nonfinite", "firing", 200), ("explode", "firing", 202)]

"""A rank's message skipped and delivered again after later ones is rolled up late, not dropped."""

from __future__ import annotations

import json
import math

import numpy as np

from rankwatch.contract import Series, TelemetryBatch
from rankwatch.stream_processors.batching import process_batch
from rankwatch.stream_processors.late import LATE_SEQS, LATE_WINDOWS
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

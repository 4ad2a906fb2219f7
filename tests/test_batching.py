"""Stage 1 over batches of messages (``batching.process_batch``) gives what message by message gives.

Replayed without a broker by ``bench/scenario_replay.py``, which makes the worker's calls in the
worker's order: once one message at a time, once ``take`` messages at a time, on telemetry of many
simulated ranks with faults (a NaN, a spike, a straggler, a rank that hangs) and, where the
recorded corpus of real training runs is present, on those recordings too, with faults written
into them (the recordings are clean, and a comparison without alerts means nothing).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from rankwatch.contract import (
    RUN_EVENTS, Alert, ProgressBatch, RankProgress, RankSignal, Series, SignalBatch, TelemetryBatch, decode_run_event,
)
from rankwatch.sim import QuietRanks
from rankwatch.stream_processors.batching import process_batch, process_in_parts
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor
from rankwatch.stream_processors.rules import Rules

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from scenario_replay import replay_pipeline  # noqa: E402

CORPUS = BENCH / "data" / "corpus_runs"


def _sim_scenario() -> tuple[str, list[TelemetryBatch]]:
    faults = {(2, 40): "nan", (5, 60): "spike", **{(3, s): "slow" for s in range(70, 90)}}
    sim = QuietRanks(run="sim-faults", ranks=8, metrics=12, faults=faults, seed=3)
    batches = []
    for tick in range(120):
        for rank in range(8):
            if rank == 6 and tick >= 100:
                continue  # rank 6 hangs: a stall
            # ranks report a step a few milliseconds apart, as real ones do
            batches.append(sim.batch(rank, tick, ts=1000.0 + tick + 0.003 * rank, final=tick == 119))
    return sim.run, batches


def _with_faults(batches: list[TelemetryBatch]) -> list[TelemetryBatch]:
    """The recorded (clean) series with faults written in, so the detectors have something to say:
    a NaN loss on the first rank at 2/5 of the run, a 100x loss spike on the last rank at 3/5 and,
    with two ranks or more, the last rank a straggler (10x compute time) for 20 steps from 4/5.
    The recordings are clean and the detectors rightly raise nothing on them (issue 18); without
    faults the batched and one-by-one paths would agree on nothing at all."""
    ranks = sorted({b.rank for b in batches})
    steps = sorted({int(s) for b in batches if "loss" in b.series for s in b.series["loss"].steps})
    if not steps:
        return batches
    nan_step, spike_step = steps[len(steps) * 2 // 5], steps[len(steps) * 3 // 5]
    slow = steps[len(steps) * 4 // 5:][:20]
    first, last = ranks[0], ranks[-1]

    def edit(batch: TelemetryBatch) -> TelemetryBatch:
        series = dict(batch.series)

        def change(name: str, at: list[int], how) -> None:
            s = series.get(name)
            mask = np.isin(s.steps, at) if s is not None else None
            if mask is not None and mask.any():
                values = s.values.copy()
                values[mask] = how(values[mask])
                series[name] = Series(s.steps, values)

        if batch.rank == first:
            change("loss", [nan_step], lambda v: np.nan)
        if batch.rank == last:
            change("loss", [spike_step], lambda v: v * 100.0)
            if len(ranks) > 1:
                change("compute_time_s", slow, lambda v: v * 10.0)
        changed = any(series[n] is not batch.series[n] for n in series)
        return dataclasses.replace(batch, series=series) if changed else batch

    return [edit(b) for b in batches]


def _corpus_scenarios() -> list[tuple[str, list[TelemetryBatch]]]:
    from scenario_runs import read_batches

    out = []
    for run_dir in sorted(CORPUS.glob("*/"))[:4] if CORPUS.is_dir() else []:
        batches = [b for f in sorted(run_dir.glob("rank*.bin")) for b in read_batches(f)]
        if batches:
            out.append((batches[0].run, _with_faults(batches)))
    return out


def _comparable(pipeline) -> tuple[list, list]:
    """Alerts and rollups without the wall-clock stamps: a batch is applied when its last message
    arrives, so its messages' arrival times move by up to the batch's spread. Of a stall, which is
    judged on the worker's timer, that leaves out the silence it measured at the tick (value, score,
    and the message quoting it); which ranks stalled, from which step, stays in."""
    def plain(obj) -> str:
        d = dataclasses.asdict(obj)
        d.pop("ts", None)
        if d.get("detector") == "stall":
            for timed in ("value", "score", "message"):
                d.pop(timed, None)
        return json.dumps(d, sort_keys=True, default=str)

    alerts = sorted(plain(e.alert) for e in pipeline.emitted)
    rollups = sorted(plain(r) for r in pipeline.rollups)
    return alerts, rollups


SCENARIOS = [_sim_scenario(), *_corpus_scenarios()]


@pytest.mark.parametrize("take", [3, 64])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[run for run, _ in SCENARIOS])
def test_batched_stage1_sends_the_same_alerts_and_rollups(scenario, take):
    run, batches = scenario
    rules = Rules.load(None)
    one_by_one = replay_pipeline(batches, rules, run)
    batched = replay_pipeline(batches, rules, run, take=take)
    alerts, rollups = _comparable(one_by_one)
    assert alerts, "the scenario raises alerts, so the comparison means something"
    assert rollups
    assert _comparable(batched) == (alerts, rollups)


def test_sim_scenario_raises_each_injected_fault():
    run, batches = _sim_scenario()
    found = {(e.alert.detector, e.alert.metric) for e in replay_pipeline(batches, Rules.load(None), run).emitted
             if e.alert.status == "firing"}
    assert {("nonfinite", "loss"), ("spike", "loss"), ("crossrank", "compute_time_s"), ("stall", "steps")} <= found


def test_the_training_shape_is_quiet_and_followed_by_a_line():
    # The benches' "training" ranks (``--shape training``) stand for a real run: their falling loss and
    # grad norm raise nothing, and the spike detectors judge them against a line (the path a real run
    # takes), while a spike on top of the fall is still caught.
    sim = QuietRanks(run="training", ranks=3, metrics=8, shape="training", faults={(1, 700): "spike"})
    batches = [sim.batch(rank, tick, ts=1000.0 + tick, final=tick == 799) for tick in range(800) for rank in range(3)]
    emitted = replay_pipeline(batches, Rules.load(None), sim.run).emitted
    assert {(e.alert.detector, e.alert.metric, e.alert.rank) for e in emitted if e.alert.status == "firing"} == {
        ("spike", "loss", 1)}
    processor, states = TelemetryProcessor(), {}
    for b in batches[:900]:
        state = states.setdefault(b.rank, RankState())
        processor.process(state, b, 0.0)
    assert all(states[r].metrics[m].detectors["spike"].trending for r in range(3) for m in ("loss", "grad_norm"))


def _progress(rank: int, step: int, run: str = "r") -> TelemetryBatch:
    return TelemetryBatch(run=run, rank=rank, world_size=4, producer="p", seq=step, ts=1.0 + step,
                          series={"compute_time_s": Series(np.array([step]), np.array([0.2]))})


def test_one_progress_event_per_run_per_batch_in_order():
    out = process_batch(TelemetryProcessor(), [_progress(r, s) for s in range(3) for r in range(4)],
                        lambda key: None, 5.0)
    events = [decode_run_event(v) for topic, _, v in out.messages if topic == RUN_EVENTS]
    assert len(events) == 1 and isinstance(events[0], ProgressBatch)
    assert [(p.rank, p.last_step) for p in events[0].items] == [(r, s) for s in range(3) for r in range(4)]
    assert set(out.states) == {f"r/{r}" for r in range(4)}


def test_a_messages_signals_go_to_stage_2_as_one_event_in_order():
    nan = TelemetryBatch(run="r", rank=2, world_size=4, producer="p", seq=0, ts=1.0,
                         series={m: Series(np.array([0]), np.array([math.nan])) for m in ("grad_norm", "loss")})
    out = process_batch(TelemetryProcessor(), [nan], lambda key: None, 5.0)
    events = [decode_run_event(v) for topic, _, v in out.messages if topic == RUN_EVENTS]
    assert isinstance(events[0], SignalBatch) and isinstance(events[1], RankProgress)
    assert [(s.alert.metric, s.alert.rank) for s in events[0].items] == [("grad_norm", 2), ("loss", 2)]


def test_a_signal_batch_over_the_size_limit_is_split_in_order():
    from rankwatch.stream_processors.batching import _signal_messages

    alert = Alert(key="r/nonfinite/m/0", run="r", status="firing", severity="critical", detector="nonfinite",
                  metric="m", rank=0, step=1, value=math.nan, message="x" * 2_000, ts=1.0, ranks=(0,))
    signals = [RankSignal(alert=dataclasses.replace(alert, metric=f"m{i}"), world_size=1) for i in range(1_000)]
    messages = _signal_messages("r", signals)
    assert len(messages) > 1 and all(len(v) <= 1_000_000 for _, _, v in messages)
    metrics = [s.alert.metric for _, _, v in messages for s in decode_run_event(v).items]
    assert metrics == [f"m{i}" for i in range(1_000)]


def test_a_batch_in_parts_gives_what_it_gives_whole():
    # The worker processes a take in parts, letting its event loop run in between (the NaN lane).
    class Exploding(TelemetryProcessor):
        def process(self, state, batch, now):
            if (batch.rank, batch.seq) == (2, 1):
                raise RuntimeError("boom")
            return super().process(state, batch, now)

    batches = [_progress(r, s) for s in range(3) for r in range(4)]
    whole = process_batch(Exploding(), batches, lambda key: None, 5.0)
    outputs = list(process_in_parts(Exploding(), batches, lambda key: None, 5.0, part=5))
    assert len(outputs) == 3  # after messages 5 and 10, and at the end
    parts = outputs[-1]
    assert [i for i, _ in parts.failed] == [i for i, _ in whole.failed] == [6]
    assert parts.messages == whole.messages and len(whole.messages) == 1  # one progress batch, not one a part
    assert {k: s.seq for k, s in parts.states.items()} == {k: s.seq for k, s in whole.states.items()}
    assert parts.applied == whole.applied == 11


def test_a_progress_batch_over_the_size_limit_is_split():
    big = {"compute_time_s": Series(np.arange(400), np.full(400, math.pi))}
    items = tuple(RankProgress(run="r", rank=r, world_size=512, last_step=399, ts=1.0, series=big) for r in range(512))
    from rankwatch.stream_processors.batching import _progress_messages

    messages = _progress_messages("r", list(items))
    assert len(messages) > 1 and all(len(v) <= 1_000_000 for _, _, v in messages)
    assert [p.rank for _, _, v in messages for p in decode_run_event(v).items] == list(range(512))


def test_a_failing_message_is_reported_and_the_rest_applied():
    class Exploding(TelemetryProcessor):
        def process(self, state, batch, now):
            if batch.rank == 1:
                raise RuntimeError("boom")
            return super().process(state, batch, now)

    out = process_batch(Exploding(), [_progress(r, 0) for r in range(3)], lambda key: None, 5.0)
    assert [i for i, _ in out.failed] == [1]
    assert set(out.states) == {"r/0", "r/2"}
    ranks = [p.rank for _, _, v in out.messages for p in decode_run_event(v).items]
    assert ranks == [0, 2]


def test_a_progress_too_large_to_send_fails_its_message_and_the_batch_goes_on():
    # A cross-rank metric of 60,000 steps makes a progress event of about 1.4 MB: over the limit, so
    # that message is reported for the dead-letter topic; the small one after it is applied.
    steps = np.arange(60_000, dtype=np.int64)
    big = TelemetryBatch(run="r", rank=0, world_size=2, producer="p", seq=0, ts=1.0,
                         series={"compute_time_s": Series(steps, np.full(len(steps), 0.123456789012345))})
    small = TelemetryBatch(run="r", rank=1, world_size=2, producer="p", seq=0, ts=1.0,
                           series={"compute_time_s": Series(steps[:1], np.array([0.1]))})
    out = process_batch(TelemetryProcessor(rules=Rules.load(None)), [big, small], lambda key: None, 1.0)
    assert [index for index, _ in out.failed] == [0]
    assert "over the limit" in str(out.failed[0][1])
    assert list(out.states) == ["r/1"] and out.applied == 1

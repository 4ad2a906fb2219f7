"""Rollups worth querying: quantiles from the window's sketch, the closing rank's partial window, and an
eval metric that is all NaN counted and alerted on. Pure code, no broker."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from rankwatch.contract import EvalShard, Rollup, Series, TelemetryBatch
from rankwatch.sketch import Sketch
from rankwatch.stream_processors.evaluation import EvalProcessor, EvalState, RunState, RunTracker
from rankwatch.stream_processors.evaluation.stats import Summary, summarize
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor


def _batch(seq, steps, values, *, final=False) -> TelemetryBatch:
    return TelemetryBatch(run="r", rank=1, world_size=4, producer="p", seq=seq, ts=0.0, final=final,
                          series={"step_time_s": Series(np.asarray(steps), np.asarray(values, dtype=float))})


def test_rollups_carry_quantiles_steps_and_a_mergeable_sketch():
    rng = np.random.default_rng(1)
    values = rng.lognormal(size=200)
    proc, state = TelemetryProcessor(rollup_steps=100), RankState()
    rollups = [r for seq, lo in enumerate(range(0, 200, 10))
               for r in proc.process(state, _batch(seq, range(lo, lo + 10), values[lo:lo + 10]), 0.0).rollups]
    [first] = rollups  # window [0, 100) closed when step 100 arrived; [100, 200) is still open
    assert (first.first_step, first.last_step, first.world_size, first.count) == (0, 99, 4, 100)
    for q, p in ((0.5, first.p50), (0.95, first.p95), (0.99, first.p99)):
        assert abs(np.mean(values[:100] <= p) - q) <= 0.02
    back = Rollup.from_bytes(first.to_bytes())
    assert back == first and Sketch.from_wire(back.sketch).count == 100


def test_a_closing_rank_sends_its_partial_window_and_keeps_it_open():
    proc, state = TelemetryProcessor(rollup_steps=50), RankState()
    proc.process(state, _batch(0, range(0, 60), np.arange(60.0)), 0.0)
    [partial] = proc.process(state, _batch(1, [60, 61], [math.nan, 100.0], final=True), 0.0).rollups
    assert (partial.start_step, partial.end_step, partial.count, partial.nonfinite) == (50, 100, 11, 1)
    assert (partial.first_step, partial.last_step, partial.last, partial.max) == (50, 61, 100.0, 100.0)
    # A restarted rank carries on in the same window: the complete rollup covers the earlier points too.
    restarted = TelemetryBatch(run="r", rank=1, world_size=4, producer="p2", seq=0, ts=0.0,
                               series={"step_time_s": Series(np.array([62, 100]), np.array([1.0, 2.0]))})
    [complete] = proc.process(state, restarted, 0.0).rollups
    assert (complete.start_step, complete.count) == (50, 12)


def test_eval_summaries_count_nonfinite_values():
    s = summarize([1.0, math.nan, math.inf, 0.0])
    assert (s.n, s.nonfinite) == (2, 2)
    assert Summary.from_dict({k: v for k, v in s.to_dict().items() if k != "nonfinite"}).nonfinite == 0  # old state


def test_an_eval_metric_that_is_all_nonfinite_raises_a_critical_alert_then_resolves():
    def shards(loss):
        ids = [np.arange(r, 40, 2) for r in range(2)]
        return [EvalShard(run="r", eval_id=f"e{int(loss[0]) if np.isfinite(loss[0]) else 'nan'}", step=10, rank=r,
                          world_size=2, chunk=0, last=True, sample_ids=ids[r],
                          metrics={"loss": loss[ids[r]], "correct": np.ones(20)}, ts=0.0, dataset_size=40)
                for r in range(2)]

    proc, tracker, runs = EvalProcessor(deadline_s=10.0, provisional_interval_s=1.0, stop_rule=None), RunTracker(), RunState()

    def evaluate(loss, step):
        state, updates = EvalState(), []
        for s in shards(loss):
            updates += proc.apply(state, EvalShard(**{**s.__dict__, "step": step}), now=time.time()).updates
        [update] = updates
        return update, tracker.apply(runs, update, now=time.time()).alerts

    update, alerts = evaluate(np.full(40, math.nan), 10)
    assert update.report.metrics["loss"]["n"] == 0 and update.report.metrics["loss"]["nonfinite"] == 40
    [alert] = alerts
    assert (alert.detector, alert.metric, alert.status, alert.severity) == ("eval_nonfinite", "loss", "firing",
                                                                            "critical")
    assert "every value of loss" in alert.message
    _, alerts = evaluate(np.ones(40), 20)
    assert [(a.detector, a.status) for a in alerts] == [("eval_nonfinite", "resolved")]


@pytest.mark.parametrize("n", [1, 50, 5000])
def test_a_sketch_round_trips_and_merges(n):
    rng = np.random.default_rng(n)
    a, b = rng.normal(size=n), rng.normal(3, 1, size=n)
    s = Sketch.of(a)
    s.merge(Sketch.from_wire(Sketch.of(b).to_wire()))
    both = np.concatenate([a, b])
    assert s.count == 2 * n
    assert abs(np.mean(both <= s.quantile(0.5)) - 0.5) <= max(0.02, 1 / n)

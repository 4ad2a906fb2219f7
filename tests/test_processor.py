"""TelemetryProcessor.process: alerts, replays, restarts and state round-trips, no broker involved."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rankwatch.contract import Alert, Rollup, Series, TelemetryBatch
from rankwatch.stream_processors.batching import process_batch
from rankwatch.stream_processors.processor import STATE_VERSION, Output, RankState, RankStateError, TelemetryProcessor
from rankwatch.stream_processors.rules import Rules


def _batch(seq: int, steps, series: dict[str, list[float]], *, producer: str = "p1", rank: int = 1) -> TelemetryBatch:
    steps = np.asarray(steps, dtype=np.int64)
    return TelemetryBatch(
        run="run-1", rank=rank, world_size=4, producer=producer, seq=seq, ts=1000.0 + seq,
        series={name: Series(steps=steps, values=np.asarray(v, dtype=np.float64)) for name, v in series.items()},
    )


def _stream(n_batches: int, per_batch: int = 20, *, seed: int = 0, nan_at: int | None = None, spike_at: int | None = None):
    """Consecutive batches of a noisy loss and a grad norm, optionally with a NaN and a spike."""
    rng = np.random.default_rng(seed)
    total = n_batches * per_batch
    loss = 2.0 + rng.normal(0.0, 0.01, total)
    grad = 1.0 + rng.normal(0.0, 0.05, total)
    if nan_at is not None:
        loss[nan_at] = np.nan
    if spike_at is not None:
        loss[spike_at] = 10.0
    return [
        _batch(i, np.arange(i * per_batch, (i + 1) * per_batch),
               {"loss": loss[i * per_batch : (i + 1) * per_batch], "grad_norm": grad[i * per_batch : (i + 1) * per_batch]})
        for i in range(n_batches)
    ]


def _wire(out: Output) -> tuple[list[bytes], list[bytes]]:
    """Outputs as their wire bytes: comparable even when a value is NaN."""
    return [a.to_bytes() for a in out.alerts], [r.to_bytes() for r in out.rollups]


def _frozen(state: RankState) -> str:
    return json.dumps(state.to_dict(), sort_keys=True, allow_nan=False)


def test_nan_produces_one_critical_nonfinite_alert_with_the_contract_fields():
    proc = TelemetryProcessor(rollup_steps=50)
    state = RankState()
    out = proc.process(state, _batch(0, [10, 11, 12], {"loss": [2.0, math.nan, 2.0]}), now=55.5)
    assert len(out.alerts) == 1
    alert = out.alerts[0]
    assert (alert.key, alert.run, alert.status, alert.severity, alert.detector, alert.metric) == (
        "run-1/nonfinite/loss/1", "run-1", "firing", "critical", "nonfinite", "loss",
    )
    assert (alert.rank, alert.step, alert.incident, alert.ts, alert.score) == (1, 11, 11, 55.5, 1.0)
    assert math.isnan(alert.value)
    assert "NaN" in alert.message and "rank 1" in alert.message
    back = Alert.from_bytes(alert.to_bytes())
    assert back.to_bytes() == alert.to_bytes() and math.isnan(back.value)


def test_nan_alert_resolves_after_the_policy_calm_period():
    proc = TelemetryProcessor(rules=_rules(resolve_after=3))
    state = RankState()
    out = proc.process(state, _batch(0, range(6), {"loss": [1.0, math.nan, 1.0, 1.0, 1.0, 1.0]}), now=0.0)
    assert [(a.detector, a.status, a.step, a.incident) for a in out.alerts] == [
        ("nonfinite", "firing", 1, 1), ("nonfinite", "resolved", 4, 1),
    ]


def test_a_spike_after_warmup_alerts_as_a_warning_and_nan_does_not_trip_the_spike_detector():
    proc = TelemetryProcessor()
    state = RankState()
    alerts = []
    for batch in _stream(10, seed=1, nan_at=120, spike_at=150):
        alerts += proc.process(state, batch, now=0.0).alerts
    firing = [(a.detector, a.metric, a.step, a.severity) for a in alerts if a.status == "firing"]
    assert firing == [("nonfinite", "loss", 120, "critical"), ("spike", "loss", 150, "warning")]


def test_rollups_close_per_metric_as_steps_advance():
    proc = TelemetryProcessor(rollup_steps=50)
    state = RankState()
    rollups: list[Rollup] = []
    batches = _stream(6, per_batch=20, seed=2)  # steps 0..119
    for b in batches:
        rollups += proc.process(state, b, now=9.0).rollups
    assert sorted((r.metric, r.start_step, r.end_step, r.count) for r in rollups) == [
        ("grad_norm", 0, 50, 50), ("grad_norm", 50, 100, 50), ("loss", 0, 50, 50), ("loss", 50, 100, 50),
    ]
    loss = np.concatenate([b.series["loss"].values for b in batches])
    first = next(r for r in rollups if r.metric == "loss" and r.start_step == 0)
    assert math.isclose(first.mean, loss[:50].mean(), rel_tol=1e-12)
    assert (first.run, first.rank, first.ts) == ("run-1", 1, 9.0)


def test_a_gauge_one_step_a_message_rolls_up_and_alerts_as_in_one_batch():
    # A plain gauge (only `nonfinite` watches it) at one step per message takes a shorter path than
    # a batch of steps: the same windows, and a NaN inside an open window still pages.
    values = 3.0 + np.random.default_rng(4).normal(0.0, 0.1, 120)
    values[77] = math.nan
    proc = TelemetryProcessor(rollup_steps=50)
    one_by_one, whole = RankState(), RankState()
    outs = [proc.process(one_by_one, _batch(s, [s], {"mem_gb": values[s : s + 1]}), now=9.0) for s in range(120)]
    out = proc.process(whole, _batch(0, np.arange(120), {"mem_gb": values}), now=9.0)
    rollups = [r for o in outs for r in o.rollups]
    exact = ("start_step", "count", "nonfinite", "min", "max", "last", "first_step", "last_step", "sketch", "p99")
    assert [[getattr(r, f) for f in exact] for r in rollups] == [[getattr(r, f) for f in exact] for r in out.rollups]
    for r, b in zip(rollups, out.rollups, strict=True):  # Welford's update one by one, Chan's merge in one
        assert math.isclose(r.mean, b.mean, rel_tol=1e-12) and math.isclose(r.std, b.std, rel_tol=1e-9)
    assert [(r.start_step, r.count, r.nonfinite) for r in rollups] == [(0, 50, 0), (50, 49, 1)]
    alerts = [a for o in outs for a in o.alerts]
    assert [(a.detector, a.status, a.step) for a in alerts] == [("nonfinite", "firing", 77),
                                                                  ("nonfinite", "resolved", 82)]
    assert [(a.detector, a.status, a.step) for a in out.alerts] == [(a.detector, a.status, a.step) for a in alerts]
    assert one_by_one.metrics["mem_gb"].window.count == whole.metrics["mem_gb"].window.count == 20


def test_replayed_batch_changes_nothing_and_emits_nothing():
    proc = TelemetryProcessor(rollup_steps=20)
    state = RankState()
    batches = _stream(4, seed=3, nan_at=65)  # seq 0..3; the NaN is in seq 3
    for b in batches[:3]:
        proc.process(state, b, now=0.0)
    before = _frozen(state)
    assert state.seq == 2
    for replay in (batches[2], batches[0], batches[1]):
        out = proc.process(state, replay, now=1.0)
        assert out.alerts == [] and out.rollups == []
        assert _frozen(state) == before
    # A replay that would alert (a NaN re-sent under an old seq) is still dropped.
    state_after = RankState.from_dict(json.loads(before))
    first = proc.process(state_after, batches[3], now=2.0)
    assert [(a.detector, a.status, a.step) for a in first.alerts] == [
        ("nonfinite", "firing", 65), ("nonfinite", "resolved", 70),
    ]
    again = proc.process(state_after, batches[3], now=3.0)
    assert again.alerts == [] and again.rollups == []


def test_is_replay():
    proc = TelemetryProcessor()
    state = RankState(producer="p1", seq=5)
    assert proc.is_replay(state, _batch(5, [0], {}))
    assert proc.is_replay(state, _batch(0, [0], {}))
    assert not proc.is_replay(state, _batch(6, [0], {}))
    assert not proc.is_replay(state, _batch(0, [0], {}, producer="p2"))
    assert not proc.is_replay(RankState(), _batch(0, [0], {}))


def test_a_new_producer_resets_numbering_and_is_processed():
    proc = TelemetryProcessor(rollup_steps=10)
    state = RankState()
    for b in _stream(3, per_batch=10, seed=4):  # producer p1, seq 0..2, steps 0..29
        proc.process(state, b, now=0.0)
    assert (state.producer, state.seq) == ("p1", 2)
    # The rank restarted: a new incarnation numbers its messages from 0 again.
    restarted = _batch(0, [30, 31, 32], {"loss": [2.0, math.nan, 2.0]}, producer="p2")
    out = proc.process(state, restarted, now=5.0)
    assert (state.producer, state.seq) == ("p2", 0)
    assert [(a.detector, a.step) for a in out.alerts] == [("nonfinite", 31)]
    assert [(r.metric, r.start_step) for r in out.rollups] == [("loss", 20)]
    # ...and the new incarnation's own replays are dropped.
    assert proc.process(state, restarted, now=6.0) == Output([], [])


def test_state_survives_a_json_round_trip_with_identical_subsequent_outputs():
    proc = TelemetryProcessor(rollup_steps=30, rules=_rules(resolve_after=4))
    batches = _stream(12, per_batch=15, seed=5, nan_at=58, spike_at=140)
    live = RankState()
    for b in batches[:4]:  # steps 0..59: the NaN incident is firing and calming at the cut
        proc.process(live, b, now=0.0)
    cond = live.metrics["loss"].conditions["nonfinite"]
    assert (cond.firing, cond.incident, cond.calm) == (True, 58, 1)
    assert live.metrics["loss"].window.count == 29  # window [30, 60) is open, NaN excluded
    restored = RankState.from_dict(json.loads(json.dumps(live.to_dict(), allow_nan=False)))
    assert _frozen(restored) == _frozen(live)
    outputs_live, outputs_restored = [], []
    for b in batches[4:]:
        outputs_live.append(_wire(proc.process(live, b, now=7.0)))
        outputs_restored.append(_wire(proc.process(restored, b, now=7.0)))
    assert outputs_restored == outputs_live
    assert _frozen(restored) == _frozen(live)
    assert any(alerts for alerts, _ in outputs_live) and any(rollups for _, rollups in outputs_live)


def test_state_round_trip_with_a_nonfinite_open_window():
    proc = TelemetryProcessor(rollup_steps=100)
    live = RankState()
    proc.process(live, _batch(0, [0, 1], {"loss": [math.inf, math.nan]}), now=0.0)  # window min/max still +-inf
    text = json.dumps(live.to_dict(), allow_nan=False)
    restored = RankState.from_dict(json.loads(text))
    nxt = _batch(1, [2, 100], {"loss": [1.0, 2.0]})
    assert _wire(proc.process(restored, nxt, now=1.0)) == _wire(proc.process(live, nxt, now=1.0))


def test_empty_state_dict_means_a_fresh_state():
    assert RankState.from_dict(None) == RankState()
    assert RankState.from_dict({}) == RankState()


def test_ranks_do_not_share_state():
    proc = TelemetryProcessor()
    a, b = RankState(), RankState()
    proc.process(a, _batch(0, [0], {"loss": [math.nan]}, rank=0), now=0.0)
    out = proc.process(b, _batch(0, [0], {"loss": [math.nan]}, rank=2), now=0.0)
    assert [al.key for al in out.alerts] == ["run-1/nonfinite/loss/2"]
    assert "loss" not in RankState().metrics


def _rules(*, resolve_after: int):
    """The default rules with another resolve_after everywhere."""
    import dataclasses

    from rankwatch.stream_processors.rules import default_rules

    base = default_rules()
    return dataclasses.replace(base, rules=tuple(dataclasses.replace(r, resolve_after=resolve_after) for r in base.rules))


def test_stage_two_gets_the_cross_rank_metrics_and_the_waits_only():
    proc = TelemetryProcessor(rollup_steps=50)
    out = proc.process(RankState(), _batch(0, [5], {"loss": [1.0], "lr": [0.1], "compute_time_s": [0.2],
                                                     "collective_wait_s": [3.0], "cpu_wait_s": [0.01]}), now=0.0)
    assert sorted(out.cross_rank) == ["collective_wait_s", "compute_time_s", "cpu_wait_s", "loss"]
    assert out.last_step == 5


def _loss_rules(*detectors: str) -> Rules:
    return Rules.from_toml("\n".join(f'[[rule]]\nmetrics = ["loss"]\ndetector = "{d}"\n' for d in detectors))


def _stored(state: RankState) -> dict:
    return json.loads(json.dumps(state.to_dict(), allow_nan=False))  # as the changelog gives it back


def test_a_state_of_another_version_is_rejected_never_misread():
    state = RankState()
    TelemetryProcessor().process(state, _stream(1)[0], now=0.0)
    stored = _stored(state)
    assert stored["version"] == STATE_VERSION
    assert _frozen(RankState.from_dict(stored)) == _frozen(state)
    with pytest.raises(RankStateError, match=rf"version 99; this worker reads version {STATE_VERSION} only"):
        RankState.from_dict({**stored, "version": 99})
    # A detector field this worker does not know (a newer release's) is not dropped silently.
    stored["metrics"]["loss"]["detectors"]["spike"]["learned_later"] = 1.0
    with pytest.raises(RankStateError, match="does not fit this worker: TypeError.*learned_later"):
        RankState.from_dict(stored)


def test_a_state_stored_before_versions_reads_as_version_one():
    state = RankState()
    TelemetryProcessor().process(state, _stream(1)[0], now=0.0)
    unversioned = {k: v for k, v in _stored(state).items() if k != "version"}
    assert _frozen(RankState.from_dict(unversioned)) == _frozen(state)


def test_an_unreadable_state_keeps_its_place_in_the_stream_and_learns_afresh():
    proc = TelemetryProcessor(rollup_steps=20)
    batches = _stream(4, seed=3, nan_at=65)
    state = RankState()
    for b in batches[:3]:
        proc.process(state, b, now=0.0)
    newer = {**_stored(state), "version": STATE_VERSION + 1}
    out = process_batch(proc, batches[1:], lambda key: newer, now=1.0)  # seq 1, 2 replayed; seq 3 new
    assert [key for key, _ in out.unreadable] == ["run-1/1"]
    assert out.failed == [] and out.applied == 1  # nothing dead-lettered; the replays still dropped
    fresh = out.states["run-1/1"]
    assert (fresh.producer, fresh.seq) == ("p1", 3)
    assert fresh.metrics["loss"].window.first_step == 60  # learning began with the first new message
    assert RankState.salvage({"producer": 7, "seq": "x"}) == RankState()  # no cursor to keep


def test_a_rule_added_or_removed_since_the_state_was_built_is_followed():
    state = RankState()
    TelemetryProcessor(rules=_loss_rules("nonfinite")).process(state, _batch(0, [0, 1], {"loss": [1.0, math.nan]}), 0.0)
    assert set(state.metrics["loss"].detectors) == {"nonfinite"} and "nonfinite" in state.metrics["loss"].conditions
    # The worker restarts with other rules: nonfinite's rule went away and explode's came.
    out = TelemetryProcessor(rules=_loss_rules("explode")).process(
        state, _batch(1, [2, 3, 4], {"loss": [1.0, 1.0, 500.0]}), 0.0)
    assert set(state.metrics["loss"].detectors) == {"explode"}
    assert "nonfinite" not in state.metrics["loss"].conditions
    # The removed rule's firing condition resolves (nothing else would), under its own key and incident.
    assert [(a.detector, a.status, a.step) for a in out.alerts] == [("nonfinite", "resolved", 2), ("explode", "firing", 4)]
    assert out.alerts[0].key == Alert.make_key("run-1", "nonfinite", "loss", 1) and out.alerts[0].incident == 1


def test_a_rule_edited_since_the_state_was_built_rebuilds_its_detector_and_an_unedited_one_keeps_learning():
    def rules(loss_direction: str) -> Rules:
        return Rules.from_toml("\n".join(
            f'[[rule]]\nmetrics = ["{m}"]\ndetector = "spike"\nparams = {{direction = "{d}"}}\n'
            for m, d in (("loss", loss_direction), ("grad_norm", "up"))))

    state = RankState()
    for b in _stream(5, seed=5):  # steps 0..99
        TelemetryProcessor(rules=rules("up")).process(state, b, now=0.0)
    # The worker restarts with the loss rule's direction edited; grad_norm's rule is the same.
    back = RankState.from_dict(_stored(state))
    TelemetryProcessor(rules=rules("down")).process(back, _batch(5, [100], {"loss": [2.0], "grad_norm": [1.0]}), 0.0)
    loss, grad = (back.metrics[m].detectors["spike"].state_dict() for m in ("loss", "grad_norm"))
    assert (loss["direction"], loss["seen"]) == ("down", 1)  # afresh, with the edited parameter
    assert (grad["direction"], grad["seen"]) == ("up", 101)  # carried on

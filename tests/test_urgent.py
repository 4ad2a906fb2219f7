"""The NaN lane: a publisher's first non-finite value, ahead of its telemetry, pages without waiting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwatch.contract import RankSignal, Series, TelemetryBatch, UrgentTelemetry, decode_run_event
from rankwatch.producers.outbox import Outbox
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import RunGroups
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor
from rankwatch.stream_processors.rules import Rules, default_rules
from rankwatch.stream_processors.urgent import urgent_signals

NAN, INF = math.nan, math.inf


def _batch(metrics: dict[str, list[float]], *, first_step: int = 0, rank: int = 1, seq: int = 0,
           kind: type[TelemetryBatch] = TelemetryBatch) -> TelemetryBatch:
    series = {m: Series(np.arange(first_step, first_step + len(v)), np.asarray(v, dtype=np.float64))
              for m, v in metrics.items()}
    return kind(run="r", rank=rank, world_size=4, producer="p", seq=seq, ts=0.0, series=series)


def test_the_lane_signal_is_the_transition_stage_one_sends_later():
    points = {"loss": [1.0, 1.0, NAN, NAN], "grad_norm": [2.0, INF, 2.0, 2.0], "lr": [0.1] * 4}
    [stage1_loss, stage1_grad] = sorted(
        TelemetryProcessor().process(RankState(), _batch(points), now=5.0).alerts, key=lambda a: a.metric, reverse=True)
    # What the publisher sends on the lane: each metric's first non-finite point.
    sent = UrgentTelemetry(run="r", rank=1, world_size=4, producer="p", seq=0, ts=0.0, series={
        "loss": Series(np.array([2]), np.array([NAN])), "grad_norm": Series(np.array([1]), np.array([INF]))})
    lane = urgent_signals(default_rules(), sent, now=5.0)
    assert [s.alert.to_dict() for s in lane] == [stage1_loss.to_dict(), stage1_grad.to_dict()]  # NaN != NaN
    assert all(s.urgent and s.world_size == 4 for s in lane)
    assert [(s.alert.step, s.alert.incident) for s in lane] == [(2, 2), (1, 1)]


def test_a_calm_before_the_nan_resolves_the_last_incident_if_it_was_long_enough():
    # What the publisher sends after an earlier NaN: the finite points since, then the new NaN.
    long_calm = urgent_signals(default_rules(), _batch({"loss": [1.0] * 6 + [NAN]}, first_step=31), now=0.0)
    assert [(s.alert.status, s.alert.step, s.alert.incident) for s in long_calm] == [
        ("resolved", 35, 30), ("firing", 37, 37)]  # resolved at the fifth calm step, as stage 1 does
    short_calm = urgent_signals(default_rules(), _batch({"loss": [1.0] * 4 + [NAN]}, first_step=31), now=0.0)
    assert short_calm == []  # still firing, as far as stage 1 goes


def _rules(extra: str) -> Rules:
    return Rules.from_toml(f'[[rule]]\nmetrics = ["*"]\nexclude = ["heartbeat_age_s"]\ndetector = "nonfinite"\n{extra}')


@pytest.mark.parametrize("rules", [_rules("for = 2"), _rules("cooldown = 5"), Rules.from_toml("")],
                         ids=["for 2", "cooldown", "no nonfinite rule"])
def test_rules_that_may_not_fire_on_the_first_point_stay_off_the_lane(rules):
    # Stage 1 might never send a transition for it, and a lane alert nothing follows would fire for ever.
    assert urgent_signals(rules, _batch({"loss": [NAN]}), now=0.0) == []


def test_finite_values_and_excluded_metrics_make_no_signal():
    assert urgent_signals(default_rules(), _batch({"loss": [1.0, 2.0], "heartbeat_age_s": [NAN]}), now=0.0) == []


def test_the_urgent_mark_survives_the_wire_and_plain_signals_stay_as_they_were():
    [signal] = urgent_signals(default_rules(), _batch({"loss": [NAN]}), now=0.0)
    back = decode_run_event(signal.to_bytes())
    assert back.urgent and back.to_bytes() == signal.to_bytes()
    plain = RankSignal(alert=signal.alert, world_size=4)
    assert b"urgent" not in plain.to_bytes() and not decode_run_event(plain.to_bytes()).urgent


def test_an_urgent_batch_is_telemetry_on_its_own_topic_and_keeps_the_next_message_number():
    box = Outbox(run="r", rank=0, world_size=1, producer="p")
    box.add([(3, "loss", NAN)])
    lane = box.urgent([(3, "loss", NAN)])
    batch = box.take()
    assert lane.TOPIC == "rankwatch.urgent" and batch.TOPIC == "rankwatch.telemetry"
    assert (lane.seq, batch.seq, lane.key) == (0, 0, b"r")  # keyed by run, like the run events it joins
    back = UrgentTelemetry.from_bytes(lane.to_bytes(binary=True))
    assert isinstance(back, UrgentTelemetry) and math.isnan(back.series["loss"].values[0])


# -- stage 2 -------------------------------------------------------------------------------------

def _lane(rank: int, step: int, *, world: int = 4) -> RankSignal:
    [signal] = urgent_signals(default_rules(), _batch({"loss": [NAN]}, first_step=step, rank=rank), now=0.0)
    return RankSignal(alert=signal.alert, world_size=world, urgent=True)


def _stage1(rank: int, values: list[float], *, first_step: int, state: RankState, seq: int,
            world: int = 4) -> list[RankSignal]:
    out = TelemetryProcessor().process(state, _batch({"loss": values}, first_step=first_step, rank=rank, seq=seq), 0.0)
    return [RankSignal(alert=a, world_size=world) for a in out.alerts if a.detector == "nonfinite"]


def test_an_urgent_group_is_due_after_the_short_wait_without_the_other_ranks_progress():
    grouper, groups = Grouper(group_wait_s=600.0, urgent_wait_s=0.05), RunGroups()
    assert grouper.add(groups, _lane(1, 30), now=0.0) == []
    assert grouper.add(groups, _lane(2, 30), now=0.01) == []  # an all-reduced NaN: its peers join
    assert grouper.tick(groups, now=0.04) == []
    [alert] = grouper.tick(groups, now=0.05)
    assert (alert.status, alert.ranks, alert.incident) == ("firing", (1, 2), 30)
    # A third rank later waits for the ordinary grouping wait, like any rank joining a sent alert.
    assert grouper.add(groups, _lane(3, 30), now=1.0) == [] and grouper.tick(groups, now=1.1) == []


def test_stage_one_then_replays_the_firing_and_resolves_it():
    grouper, groups, rank = Grouper(group_wait_s=600.0), RunGroups(), RankState()
    grouper.add(groups, _lane(1, 30), now=0.0)
    assert len(grouper.tick(groups, now=1.0)) == 1
    for signal in _stage1(1, [1.0] * 20 + [NAN], first_step=10, state=rank, seq=0):
        assert grouper.add(groups, signal, now=2.0) == []  # the same firing: a replay
    [resolved] = [a for s in _stage1(1, [1.0] * 5, first_step=31, state=rank, seq=1)
                  for a in grouper.add(groups, s, now=3.0)]
    assert (resolved.status, resolved.ranks, resolved.incident) == ("resolved", (1,), 30)


def test_a_second_nan_after_a_long_enough_calm_pages_before_stage_one_catches_up():
    grouper, groups, rank = Grouper(group_wait_s=0.0, urgent_wait_s=0.0), RunGroups(), RankState()
    grouper.add(groups, _lane(1, 30, world=1), now=0.0)
    calm_then_nan = urgent_signals(default_rules(), _batch({"loss": [1.0] * 6 + [NAN]}, first_step=31), now=1.0)
    paged = [a for s in calm_then_nan for a in grouper.add(groups, s, now=1.0)] + grouper.tick(groups, now=1.0)
    assert [(a.status, a.incident) for a in paged] == [("resolved", 30), ("firing", 37)]
    # Stage 1 catches up: everything it says is a replay of what the lane said.
    behind = _stage1(1, [1.0] * 20 + [NAN] + [1.0] * 6 + [NAN], first_step=10, state=rank, seq=0, world=1)
    assert [a.status for a in (s.alert for s in behind)] == ["firing", "resolved", "firing"]
    assert [a for s in behind for a in grouper.add(groups, s, now=2.0)] == []


def test_a_lane_signal_for_a_rank_stage_one_still_has_firing_is_dropped():
    # NaN at 30, finite for two steps (stage 1 keeps firing: it resolves after five), NaN again at 33:
    # the publisher sends the second NaN on the lane too, but only stage 1 knows the rank never resolved.
    grouper, groups, rank = Grouper(group_wait_s=0.0), RunGroups(), RankState()
    signals = _stage1(1, [1.0] * 20 + [NAN, 1.0, 1.0, NAN], first_step=10, state=rank, seq=0)
    paged = [a for s in signals for a in grouper.add(groups, s, now=0.0)] + grouper.tick(groups, now=0.0)
    assert [(a.status, a.incident) for a in paged] == [("firing", 30)]
    assert grouper.add(groups, _lane(1, 33), now=1.0) == []
    [resolved] = [a for s in _stage1(1, [1.0] * 5, first_step=34, state=rank, seq=1)
                  for a in grouper.add(groups, s, now=2.0)]
    assert (resolved.status, resolved.incident) == ("resolved", 30)
    assert not groups.waiting()

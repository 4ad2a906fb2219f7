"""Stage 2: per-rank transitions become one alert per condition of a run."""

from __future__ import annotations

import json

import pytest

from rankwatch.contract import Alert, RankSignal
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import RunGroups


def _signal(rank: int, status: str = "firing", *, incident: int = 120, step: int = 120, world: int = 8) -> RankSignal:
    alert = Alert(
        key=Alert.make_key("r", "nonfinite", "loss", rank), run="r", status=status, severity="critical",
        detector="nonfinite", metric="loss", rank=rank, step=step, value=float("nan"),
        message=f"loss is NaN on rank {rank} at step {step} (nonfinite)", ts=0.0, incident=incident, ranks=(rank,),
    )
    return RankSignal(alert=alert, world_size=world)


def test_every_rank_firing_at_once_is_one_alert_sent_without_waiting():
    grouper, state = Grouper(group_wait_s=10.0), RunGroups()
    out = [a for r in range(8) for a in grouper.add(state, _signal(r), now=0.0)]
    [alert] = out
    assert alert.ranks == tuple(range(8)) and alert.rank is None
    assert alert.key == "r/nonfinite/loss" and alert.status == "firing" and alert.incident == 120
    assert "8 ranks (0, 1, 2, 3, 4, 5, 6, 7)" in alert.message


def test_some_ranks_are_grouped_after_the_wait():
    grouper, state = Grouper(group_wait_s=0.1), RunGroups()
    assert grouper.add(state, _signal(2), now=0.0) == []
    assert grouper.add(state, _signal(5), now=0.05) == []
    assert grouper.tick(state, now=0.08) == []
    [alert] = grouper.tick(state, now=0.11)
    assert alert.ranks == (2, 5)
    assert grouper.tick(state, now=1.0) == []


def test_a_single_rank_keeps_its_rank_and_message():
    grouper, state = Grouper(group_wait_s=0.0), RunGroups()
    grouper.add(state, _signal(3), now=0.0)
    [alert] = grouper.tick(state, now=0.0)
    assert (alert.rank, alert.ranks) == (3, (3,))
    assert alert.message == "loss is NaN on rank 3 at step 120 (nonfinite)"


def test_replayed_signals_emit_nothing_again():
    grouper, state = Grouper(group_wait_s=0.0), RunGroups()
    first = grouper.add(state, _signal(1, world=1), now=0.0)
    assert len(first) == 1
    assert grouper.add(state, _signal(1, world=1), now=1.0) == []
    resolved = grouper.add(state, _signal(1, "resolved", step=130, world=1), now=2.0)
    assert [a.status for a in resolved] == ["resolved"]
    # An at-least-once replay of the whole history after the incident closed:
    assert grouper.add(state, _signal(1, world=1), now=3.0) == []
    assert grouper.add(state, _signal(1, "resolved", step=130, world=1), now=3.0) == []
    # A genuinely new incident fires again.
    assert len(grouper.add(state, _signal(1, incident=200, step=200, world=1), now=4.0)) == 1


def test_a_rank_joining_later_resends_the_group_and_resolve_names_all():
    grouper, state = Grouper(group_wait_s=0.1, group_interval_s=1.0), RunGroups()
    grouper.add(state, _signal(0), now=0.0)
    [first] = grouper.tick(state, now=0.2)
    grouper.add(state, _signal(6, step=125), now=0.3)
    assert grouper.tick(state, now=0.5) == [] and state.waiting()  # within a second of the first send
    assert grouper.due_in(state, now=0.5) == pytest.approx(0.7)
    [update] = grouper.tick(state, now=1.2)
    assert (first.ranks, update.ranks) == ((0,), (0, 6))
    assert update.incident == first.incident and update.key == first.key
    assert grouper.add(state, _signal(0, "resolved", step=140), now=1.0) == []
    [resolved] = grouper.add(state, _signal(6, "resolved", step=141), now=1.1)
    assert resolved.status == "resolved" and resolved.ranks == (0, 6) and resolved.step == 141


def test_a_burst_shorter_than_the_wait_is_still_reported():
    grouper, state = Grouper(group_wait_s=5.0), RunGroups()
    assert grouper.add(state, _signal(4), now=0.0) == []
    out = grouper.add(state, _signal(4, "resolved", step=125), now=0.5)
    assert [a.status for a in out] == ["firing", "resolved"]


def test_state_survives_json_round_trip_mid_wait():
    grouper, state = Grouper(group_wait_s=0.1), RunGroups()
    grouper.add(state, _signal(2), now=0.0)
    state = RunGroups.from_dict(json.loads(json.dumps(state.to_dict())))
    grouper.add(state, _signal(2), now=0.01)  # replay after a restart: still one rank
    [alert] = grouper.tick(state, now=0.2)
    assert alert.ranks == (2,)


def test_a_group_is_sent_once_every_rank_has_reported_past_its_step():
    grouper, state = Grouper(group_wait_s=60.0), RunGroups()
    for r in range(4):
        grouper.progress(state, r, 119, 4, now=0.0)
    assert grouper.add(state, _signal(2, world=4), now=0.0) == []
    assert grouper.progress(state, 2, 120, 4, now=0.0) == []
    assert grouper.progress(state, 0, 120, 4, now=0.0) == []
    assert grouper.progress(state, 1, 121, 4, now=0.0) == []
    [alert] = grouper.progress(state, 3, 120, 4, now=0.01)  # the last rank was fine at step 120
    assert alert.ranks == (2,)
    assert grouper.progress(state, 3, 121, 4, now=0.02) == []


def test_a_silent_rank_delays_the_group_only_until_the_wait():
    grouper, state = Grouper(group_wait_s=1.0), RunGroups()
    grouper.add(state, _signal(0, world=2), now=0.0)
    grouper.progress(state, 0, 120, 2, now=0.0)  # rank 1 never reports
    assert grouper.tick(state, now=0.5) == []
    assert len(grouper.tick(state, now=1.0)) == 1


def test_the_earliest_incident_names_the_group_even_when_it_arrives_second():
    grouper, state = Grouper(group_wait_s=0.1), RunGroups()
    grouper.add(state, _signal(3, incident=121, step=121), now=0.0)  # ranks' partitions race
    grouper.add(state, _signal(2, incident=120, step=120), now=0.01)
    [alert] = grouper.tick(state, now=0.2)
    assert (alert.incident, alert.step, alert.ranks) == (120, 120, (2, 3))
    assert "rank 2 at step 120" in alert.message


def test_a_job_restarted_with_fewer_ranks_is_grouped_without_waiting_for_the_ranks_it_left():
    grouper, state = Grouper(group_wait_s=10.0), RunGroups()
    for rank in range(4):
        grouper.progress(state, rank, 99, 4, now=0.0)
    for rank in range(3):  # the elastic job restarted on three nodes
        grouper.progress(state, rank, 50, 3, now=1.0, restarted=True)
    assert grouper.add(state, _signal(1, incident=60, step=60, world=3), now=2.0) == []
    # They repeat steps they had reached: a rank is past step 60 once it is, again.
    assert grouper.progress(state, 0, 60, 3, now=2.0) == grouper.progress(state, 1, 60, 3, now=2.0) == []
    [alert] = grouper.progress(state, 2, 60, 3, now=2.0)  # every rank of the three past step 60, none waited for
    assert (alert.ranks, alert.incident) == ((1,), 60)


def test_a_run_wide_transition_passes_through_once():
    grouper, state = Grouper(group_wait_s=10.0), RunGroups()
    alert = Alert(key="r/stall/steps", run="r", status="firing", severity="critical", detector="stall",
                  metric="steps", rank=None, step=50, value=30.0, message="the run stalled", ts=0.0, incident=50)
    [out] = grouper.add(state, RankSignal(alert=alert, world_size=4), now=1.0)
    assert (out.key, out.rank, out.ranks, out.ts) == ("r/stall/steps", None, (), 1.0)
    assert Alert.from_bytes(out.to_bytes()) == out
    assert grouper.add(state, RankSignal(alert=alert, world_size=4), now=2.0) == []

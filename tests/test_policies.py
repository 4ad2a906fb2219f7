"""AlertPolicy: one firing per incident, silence while firing, one resolve, a new incident after."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwatch.contract import Alert
from rankwatch.stream_processors.policies import AlertPolicy, Condition


def _apply(policy: AlertPolicy, cond: Condition, bad: list[bool], *, start: int = 0, values=None, rank=2):
    n = len(bad)
    steps = np.arange(start, start + n, dtype=np.int64)
    values = np.asarray(values if values is not None else np.where(bad, 9.0, 1.0), dtype=np.float64)
    scores = np.where(bad, 0.999, 0.1)
    return policy.apply(
        cond, run="run-1", rank=rank, metric="loss", detector="spike", severity="warning",
        steps=steps, values=values, scores=scores, anomalous=np.asarray(bad, dtype=bool), now=123.5,
    )


def test_fires_once_per_incident_and_stays_silent_while_firing():
    cond = Condition()
    alerts = _apply(AlertPolicy(resolve_after=5), cond, [False, False, True, True, True, False, True, True])
    assert [(a.status, a.step) for a in alerts] == [("firing", 2)]
    assert cond.firing and cond.incident == 2 and cond.calm == 0


def test_firing_alert_carries_the_contract_fields():
    [alert] = _apply(AlertPolicy(), Condition(), [False, True], start=100)
    assert alert == Alert(
        key="run-1/spike/loss/2", run="run-1", status="firing", severity="warning", detector="spike",
        metric="loss", rank=2, step=101, value=9.0, message=alert.message, ts=123.5, score=0.999,
        incident=101, ranks=(2,),
    )
    assert "loss" in alert.message and "rank 2" in alert.message and "101" in alert.message
    assert Alert.from_bytes(alert.to_bytes()) == alert


def test_resolves_after_resolve_after_consecutive_normal_points():
    cond = Condition()
    policy = AlertPolicy(resolve_after=3)
    alerts = _apply(policy, cond, [True, False, False, False, False, False], start=10)
    assert [(a.status, a.step, a.incident) for a in alerts] == [("firing", 10, 10), ("resolved", 13, 10)]
    assert not cond.firing and cond.calm == 0
    assert "back to normal" in alerts[1].message and alerts[1].key == alerts[0].key


def test_a_bad_point_while_calming_restarts_the_count():
    cond = Condition()
    policy = AlertPolicy(resolve_after=3)
    #            0     1      2      3     4      5      6      7
    bad = [True, False, False, True, False, False, False, False]
    alerts = _apply(policy, cond, bad)
    assert [(a.status, a.step) for a in alerts] == [("firing", 0), ("resolved", 6)]
    assert all(a.incident == 0 for a in alerts)


def test_refires_as_a_new_incident_with_a_new_incident_step():
    cond = Condition()
    policy = AlertPolicy(resolve_after=2)
    bad = [True, False, False, False, True, True, False, False]
    alerts = _apply(policy, cond, bad, start=50)
    assert [(a.status, a.step, a.incident) for a in alerts] == [
        ("firing", 50, 50), ("resolved", 52, 50), ("firing", 54, 54), ("resolved", 57, 54),
    ]
    transitions = {(a.key, a.status, a.incident) for a in alerts}
    assert len(transitions) == len(alerts)  # consumers can dedup on (key, status, incident)


def test_state_carries_across_calls_as_if_one_call():
    bad = [False, True, True, False, True, False, False, False, True, False, False, False, False, False]
    policy = AlertPolicy(resolve_after=3)
    whole = _apply(policy, Condition(), bad)
    cond, pieces = Condition(), []
    for lo in range(0, len(bad), 3):
        pieces += _apply(policy, cond, bad[lo : lo + 3], start=lo)
        cond = Condition(**cond.to_dict())  # the state survives as its dict
    assert [a.to_bytes() for a in pieces] == [a.to_bytes() for a in whole]
    assert [a.status for a in whole] == ["firing", "resolved", "firing", "resolved"]


def test_normal_points_when_not_firing_emit_nothing_and_leave_state_alone():
    cond = Condition()
    assert _apply(AlertPolicy(), cond, [False] * 50) == []
    assert cond == Condition()


def test_empty_input_emits_nothing():
    cond = Condition(firing=True, incident=7, calm=2)
    assert _apply(AlertPolicy(), cond, []) == []
    assert cond.to_dict() == {"firing": True, "incident": 7, "streak": 0, "calm": 2, "quiet_until": -1}


def test_nan_value_is_described_and_carried():
    [alert] = _apply(AlertPolicy(), Condition(), [True], values=[math.nan], start=5)
    assert math.isnan(alert.value)
    assert "NaN" in alert.message
    assert math.isnan(Alert.from_bytes(alert.to_bytes()).value)


def test_cross_rank_condition_uses_all_in_key_and_message():
    [alert] = _apply(AlertPolicy(), Condition(), [True], rank=None)
    assert alert.rank is None and alert.key == "run-1/spike/loss"
    assert "the run" in alert.message


@pytest.mark.parametrize("resolve_after", [1, 4])
def test_resolve_after_is_exact(resolve_after):
    cond = Condition()
    bad = [True] + [False] * (resolve_after - 1)
    alerts = _apply(AlertPolicy(resolve_after=resolve_after), cond, bad)
    assert [a.status for a in alerts] == ["firing"]
    assert cond.firing
    more = _apply(AlertPolicy(resolve_after=resolve_after), cond, [False], start=resolve_after)
    assert [(a.status, a.step) for a in more] == [("resolved", resolve_after)]


def test_condition_to_dict():
    assert Condition(firing=True, incident=12, calm=3).to_dict() == {
        "firing": True, "incident": 12, "streak": 0, "calm": 3, "quiet_until": -1
    }
    assert Condition(**Condition(True, 12, 3).to_dict()) == Condition(True, 12, 3)


def test_for_waits_for_consecutive_anomalies_and_incident_is_the_first_of_them():
    cond = Condition()
    alerts = _apply(AlertPolicy(for_=3), cond, [True, True, False, True, True, True, True], start=50)
    assert [(a.status, a.step, a.incident) for a in alerts] == [("firing", 55, 53)]


def test_cooldown_keeps_a_resolved_condition_quiet_for_that_many_steps():
    cond = Condition()
    policy = AlertPolicy(resolve_after=2, cooldown=5)
    # fire at 0, resolve at 2, anomalies at 4 and 7 are inside the cooldown, 8 is past it
    flags = [True, False, False, False, True, False, False, True, True]
    alerts = _apply(policy, cond, flags, start=0)
    assert [(a.status, a.step) for a in alerts] == [("firing", 0), ("resolved", 2), ("firing", 8)]

"""What tells the worker that its broker came back empty (pure; the real restart is in test_broker_restart.py)."""

from __future__ import annotations

from rankwatch.stream_processors.brokerwatch import BrokerView, new_broker_reason

EXPECTED = {"rankwatch.telemetry": 8, "rankwatch.alerts": 8}


def test_the_same_broker_with_more_messages_is_not_new():
    view = BrokerView(dict(EXPECTED), {("rankwatch.telemetry", 0): 12})
    assert new_broker_reason(EXPECTED, {("rankwatch.telemetry", 0): 10}, view) == ""


def test_a_topic_gone_a_default_partition_count_or_offsets_going_back_mean_a_new_broker():
    gone = BrokerView({"rankwatch.telemetry": 8})
    assert new_broker_reason(EXPECTED, {}, gone) == "topic rankwatch.alerts is gone"
    auto_created = BrokerView({"rankwatch.telemetry": 4, "rankwatch.alerts": 8})
    assert "has 4 partitions, not 8" in new_broker_reason(EXPECTED, {}, auto_created)
    emptied = BrokerView(dict(EXPECTED), {("rankwatch.telemetry", 3): 1})
    assert "went back from 40 to 1" in new_broker_reason(EXPECTED, {("rankwatch.telemetry", 3): 40}, emptied)

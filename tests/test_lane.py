"""The NaN lane's own reader: a consumer beside Faust's, so that a page never waits behind telemetry."""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future

import numpy as np
import pytest
from kafka import KafkaProducer

from rankwatch.admin import connect_admin, ensure_topics
from rankwatch.contract import Series, UrgentTelemetry
from rankwatch.stream_processors.alert_sender import Paging
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import Group, RunGroups
from rankwatch.stream_processors.lane import POLL_S, LaneMarks, LanePager, LaneReader
from rankwatch.stream_processors.rules import Rules


def test_whichever_reader_reaches_a_record_first_applies_it_and_the_other_does_not():
    marks = LaneMarks()
    assert marks.by_agent(0, 4)  # before the reader had the partition
    assert marks.by_reader(0, 7) and marks.by_reader(0, 8)
    assert not marks.by_reader(0, 7)  # delivered twice (a reassignment): applied once
    assert marks.by_agent(0, 5) and marks.by_agent(0, 6)  # the reader started at 7: these are the agent's
    assert not marks.by_agent(0, 7) and not marks.by_agent(0, 8)
    assert marks.by_agent(0, 9)  # the agent got there first ...
    assert not marks.by_reader(0, 9)  # ... so the reader does not apply it again
    assert marks.by_reader(1, 9)  # partitions are counted apart


def test_a_record_the_reader_failed_on_goes_back_to_the_agent():
    marks = LaneMarks()
    assert marks.by_reader(0, 3)
    marks.release(0, 3)
    assert marks.by_agent(0, 3)  # and dead-letters it, if it fails there too


def test_a_partition_handed_over_is_forgotten():
    marks = LaneMarks()
    assert marks.by_reader(2, 10) and marks.by_agent(3, 20)
    marks.forget([2, 3])
    assert marks.by_agent(2, 10)  # back from another worker: its agent reads from the committed offset
    assert marks.by_reader(3, 15)


def test_the_reader_delivers_what_is_written_after_it_got_a_partition_and_nothing_else(bootstrap, run_id):
    topic = f"lane-{run_id}"
    ensure_topics(bootstrap, 2, (topic,))
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    before = producer.send(topic, b"before", partition=0).get(10).offset
    got: queue.Queue = queue.Queue()
    reader = LaneReader(bootstrap, topic, lambda *record: got.put(record))
    reader.wanted = frozenset({0})
    reader.start()
    try:
        first = None  # the reader seeks to the end when it gets the partition: write until it hears one
        deadline = time.monotonic() + 30
        while first is None and time.monotonic() < deadline:
            producer.send(topic, b"other partition", partition=1)
            producer.send(topic, b"after", partition=0).get(10)
            try:
                first = got.get(timeout=0.5)
            except queue.Empty:
                pass
        assert first is not None, "the reader delivered nothing in 30 s"
        assert first[0] == 0 and first[1] > before and first[2] == b"after"
        sent = producer.send(topic, b"last", partition=0).get(10).offset
        records = [first]
        while records[-1][1] < sent:
            records.append(got.get(timeout=10))
        assert [r[0] for r in records] == [0] * len(records)  # partition 1 is not wanted
        assert [r[1] for r in records] == sorted({r[1] for r in records})  # in order, once each
        assert records[-1] == (0, sent, b"last")
    finally:
        reader.stop()
        producer.close()
        admin = connect_admin(bootstrap)
        admin.delete_topics([topic])
        admin.close()
    assert not reader.is_alive()


class _Recorder:
    """Stands in for ``AlertSender`` (pure logic here): records what each decision handed over."""

    def __init__(self):
        self.sent: list[list] = []

    def submit(self, messages) -> Future:
        self.sent.append(list(messages))
        future: Future = Future()
        future.set_result(None)
        return future


def _pager(ready=lambda: True):
    groups: dict[bytes, RunGroups] = {}
    recorder = _Recorder()
    paging = Paging(recorder, lambda *alerts: list(alerts))
    pager = LanePager(rules=Rules.load(None), grouper=Grouper(), paging=paging, groups_of=groups.get, ready=ready)
    handed, kept = [], []
    pager.connect(lambda *record: handed.append(record), lambda *args: kept.append(args))
    return pager, groups, recorder, handed, kept


def _nan(run: str, rank: int, step: int, world_size: int = 2) -> bytes:
    return UrgentTelemetry(run=run, rank=rank, world_size=world_size, producer="p", seq=0, ts=time.time(),
                           series={"loss": Series(np.array([step]), np.array([float("nan")]))}).to_bytes(binary=True)


def test_the_lanes_thread_pages_a_run_the_loop_has_grouped_and_hands_over_any_other():
    pager, groups, recorder, handed, kept = _pager()
    pager.deliver(3, 10, _nan("r", 0, 30))
    assert [h[:2] for h in handed] == [(3, 10)] and not recorder.sent  # the loop has not seen run r yet
    groups[b"r"], pager.partitions[b"r"] = RunGroups(), 3
    pager.deliver(3, 11, _nan("r", 0, 30))
    assert len(handed) == 1 and not recorder.sent  # grouped, waiting for the other ranks' lane records
    assert kept == [(b"r", groups[b"r"], None)]  # the loop writes the run's groups
    assert pager.tick() <= Grouper().urgent_wait_s
    time.sleep(Grouper().urgent_wait_s)
    assert pager.tick() == POLL_S  # sent: nothing waits any more
    [[page]] = recorder.sent
    assert (page.status, page.detector, page.metric, page.ranks, page.incident) == ("firing", "nonfinite", "loss", (0,), 30)
    assert kept[-1][:2] == (b"r", groups[b"r"]) and kept[-1][2].done()
    pager.deliver(3, 11, _nan("r", 0, 30))  # the same record again (a reassignment): applied once
    pager.tick()
    assert len(recorder.sent) == 1


def test_a_record_the_agent_applied_first_or_one_read_while_rebalancing_is_left_to_the_agent():
    ready = [True]
    pager, groups, recorder, handed, kept = _pager(lambda: ready[0])
    groups[b"r"], pager.partitions[b"r"] = RunGroups(), 0
    assert pager.marks.by_agent(0, 5)
    pager.deliver(0, 5, _nan("r", 0, 30))
    ready[0] = False
    pager.deliver(0, 6, _nan("r", 1, 30))
    assert not kept and not handed and not recorder.sent
    pager.deliver(0, 7, b"not a lane record")  # the agent dead-letters it
    assert not handed


def test_a_run_handed_over_goes_back_to_the_loop():
    pager, groups, recorder, handed, kept = _pager()
    groups[b"r"], pager.partitions[b"r"] = RunGroups(), 1
    pager.deliver(1, 0, _nan("r", 0, 30))
    pager.forget(partitions=[1], everything=True)
    assert pager.tick() == POLL_S and not recorder.sent  # its group is the new owner's to send
    pager.deliver(1, 1, _nan("r", 1, 40))
    assert [h[:2] for h in handed] == [(1, 1)]


def test_grouper_says_when_a_waiting_group_is_due():
    grouper, state = Grouper(group_wait_s=1.0), RunGroups()
    assert grouper.due_in(state, 100.0) is None
    state.groups["g"] = Group(pending_since=99.5)
    assert grouper.due_in(state, 100.0) == pytest.approx(0.5)
    state.groups["u"] = Group(pending_since=99.99, urgent=True)
    assert grouper.due_in(state, 100.0) == pytest.approx(0.04)
    assert grouper.due_in(state, 101.0) == 0.0

"""The NaN lane's own reader: a consumer beside Faust's, so that a page never waits behind telemetry."""

from __future__ import annotations

import queue
import time

from kafka import KafkaProducer

from rankwatch.admin import connect_admin, ensure_topics
from rankwatch.stream_processors.lane import LaneMarks, LaneReader


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

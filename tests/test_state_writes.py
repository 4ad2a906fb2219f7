"""``StateWrites``: a rank's state is written on a schedule, and the events it records are acknowledged
only after it is written (the committed offset must never pass the written state). The pure logic
first, then the worker on the real broker; a crash and a clean stop are in test_alert_engine.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import consume_json
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.stream_processors.state_writes import StateWrites


class _Log(list):
    """One ordered record of what the table and the events saw."""


class _Table(dict):
    def __init__(self, log: _Log):
        super().__init__()
        self.log = log

    def __setitem__(self, key, value):
        self.log.append(("write", key, value))
        super().__setitem__(key, value)


class _Event:
    def __init__(self, log: _Log, name: str):
        self.log, self.name = log, name

    def ack(self) -> bool:
        self.log.append(("ack", self.name))
        return True


def test_events_are_acknowledged_only_after_the_state_that_records_them_is_written():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    writes.add([_Event(log, "a0"), _Event(log, "b0")], {b"r/0": "state a0", b"r/1": "state b0"})
    writes.add([_Event(log, "a1")], {b"r/0": "state a1"})
    assert log == [] and len(writes) == 3  # nothing written, nothing acknowledged yet
    assert writes.get(b"r/0") == "state a1", "a state not written yet is read back, or the next batch starts blank"

    writes.write(now=100.0)
    assert log == [("write", b"r/0", "state a1"), ("write", b"r/1", "state b0"),  # the latest state per key, once
                   ("ack", "a0"), ("ack", "b0"), ("ack", "a1")]
    assert len(writes) == 0 and writes.get(b"r/0") == "state a1"  # from the table now


def test_a_write_is_due_every_interval_or_at_once_when_asked_and_never_with_nothing_held():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    assert not writes.due(0.0, now_anyway=True)  # nothing held: nothing to write
    writes.add([_Event(log, "a0")], {b"r/0": "s"})
    assert writes.due(0.0)  # the first write after a quiet spell goes at once
    writes.write(now=10.0)
    writes.add([_Event(log, "a1")], {b"r/0": "s1"})
    assert not writes.due(14.9)
    assert writes.due(14.9, now_anyway=True)  # a rebalance or a stop does not wait
    assert writes.due(15.0)


def test_a_batch_of_dead_letters_is_acknowledged_with_no_state_to_write():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    writes.add([_Event(log, "bad")], {})
    writes.write(now=1.0)
    assert log == [("ack", "bad")]


@pytest.mark.broker
def test_a_rank_whose_first_state_is_not_written_yet_keeps_it_across_batches(bootstrap, run_id):
    """Between writes, a new rank's state exists only in the pending writes: a worker that read the
    table alone started each of its messages blank, and its first window rolled up short."""
    producer = KafkaProducer(bootstrap_servers=bootstrap)

    def send(rank: int, seq: int, steps: range) -> None:
        batch = TelemetryBatch(run=run_id, rank=rank, world_size=2, producer="p", seq=seq, ts=time.time(),
                               series={"loss": Series(np.array(steps), np.ones(len(steps)))})
        producer.send(contract.TELEMETRY, batch.to_bytes(), key=batch.key)
        producer.flush()
        time.sleep(0.15)  # separate takes (the worker batches what arrives within 20 ms)

    try:
        send(0, 0, range(0, 4))  # a write goes out at about this time; rank 1 comes after it
        for seq, first in enumerate(range(0, 12, 4)):  # steps 0-11: the third message closes window [0, 10)
            send(1, seq, range(first, first + 4))
    finally:
        producer.close()
    [rollup] = consume_json(bootstrap, contract.REPORTS, lambda r: r.get("kind") == "rollup" and r["run"] == run_id
                            and r["rank"] == 1 and r["start_step"] == 0)
    assert rollup["count"] == 10, rollup

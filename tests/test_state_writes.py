"""``StateWrites``: a rank's state is written on a schedule, and the events it records are acknowledged
only after it is written (the committed offset must never pass the written state). Pure logic; the
worker's use of it on a real broker is tested in test_alert_engine.py."""

from __future__ import annotations

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
    writes.add([_Event(log, "a0"), _Event(log, "b0")], {"r/0": "state a0", "r/1": "state b0"})
    writes.add([_Event(log, "a1")], {"r/0": "state a1"})
    assert log == [] and len(writes) == 3  # nothing written, nothing acknowledged yet

    writes.write(now=100.0)
    assert log == [("write", b"r/0", "state a1"), ("write", b"r/1", "state b0"),  # the latest state per key, once
                   ("ack", "a0"), ("ack", "b0"), ("ack", "a1")]
    assert len(writes) == 0


def test_a_write_is_due_every_interval_or_at_once_when_asked_and_never_with_nothing_held():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    assert not writes.due(0.0, now_anyway=True)  # nothing held: nothing to write
    writes.add([_Event(log, "a0")], {"r/0": "s"})
    assert writes.due(0.0)  # the first write after a quiet spell goes at once
    writes.write(now=10.0)
    writes.add([_Event(log, "a1")], {"r/0": "s1"})
    assert not writes.due(14.9)
    assert writes.due(14.9, now_anyway=True)  # a rebalance or a stop does not wait
    assert writes.due(15.0)


def test_a_batch_of_dead_letters_is_acknowledged_with_no_state_to_write():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    writes.add([_Event(log, "bad")], {})
    writes.write(now=1.0)
    assert log == [("ack", "bad")]

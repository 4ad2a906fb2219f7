"""``StateWrites``: a rank's state is written on a schedule, and the events it records are acknowledged
only after it is written (the committed offset must never pass the written state). The pure logic
first, then the worker on the real broker; a crash and a clean stop are in test_alert_engine.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import consume_json
from kafka import KafkaConsumer, KafkaProducer

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.stack import Stack
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


def test_a_gradual_write_lets_the_loop_run_between_slices_and_acks_after_the_last():
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    writes.add([_Event(log, "a0")], {b"r/%d" % i: f"s{i}" for i in range(5)})
    between: list[tuple[int, str | None]] = []

    async def meanwhile():  # another coroutine on the loop: a lane page, stage 2
        for i in range(3):
            between.append((len(log), writes.get(b"r/4")))
            if i == 1:
                writes.add([_Event(log, "later")], {b"r/0": "newer"})
            await asyncio.sleep(0)

    async def both():
        await asyncio.gather(writes.write_gradually(now=1.0, slice_size=2), meanwhile())

    asyncio.run(both())
    assert [entry[0] for entry in log] == ["write"] * 5 + ["ack"]  # acked once all five are written
    assert between[0][0] == 2 and between[1][0] == 4  # two states a slice, the loop let in between
    assert all(state == "s4" for _, state in between), "a state being written is read back meanwhile"
    assert writes.get(b"r/0") == "newer" and len(writes) == 1  # what came meanwhile waits for the next write


def test_a_write_at_once_finishes_a_gradual_one_under_way():
    # A rebalance or a stop does not wait for the loop: everything held is written and acked then.
    log = _Log()
    writes = StateWrites(_Table(log), every_s=5.0)
    writes.add([_Event(log, "a0")], {b"r/%d" % i: "s" for i in range(4)})

    async def interrupted():
        task = asyncio.ensure_future(writes.write_gradually(now=1.0, slice_size=1))
        await asyncio.sleep(0)
        writes.write(now=1.0)
        await task

    asyncio.run(interrupted())
    assert [entry[0] for entry in log] == ["write"] * 4 + ["ack"] and len(writes) == 0


def test_state_expires_after_its_ttl_of_silence_only_on_the_worker_that_owns_it():
    log = _Log()
    table = _Table(log)
    writes = StateWrites(table, every_s=5.0)
    dict.update(table, {b"recovered": "s", b"elsewhere": "s"})  # read back from the changelog at start
    writes.add([], {b"busy": "s0", b"quiet": "s0"})
    writes.write(now=0.0)
    mine = lambda key: key != b"elsewhere"  # noqa: E731
    assert writes.expire(0.0, 10.0, mine) == []  # silence counts from here, for the recovered key too
    writes.add([], {b"busy": "s1"})
    assert writes.expire(9.0, 10.0, mine) == []
    assert sorted(writes.expire(10.0, 10.0, mine)) == [b"quiet", b"recovered"]
    assert set(table) == {b"busy", b"elsewhere"}  # another worker's key is its to expire
    assert writes.expire(19.0, 10.0, mine) == [b"busy"]
    assert writes.expire(100.0, 10.0, lambda key: True) == []  # owned from now on: its silence counts from now
    assert writes.expire(110.0, 10.0, lambda key: True) == [b"elsewhere"]
    assert not table


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


@pytest.fixture(scope="module")
def forgetful_stack(tmp_path_factory):
    # A TTL over the write interval (Settings.state_write_s), so the state is written before it expires.
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("ttl")), app_id="rankwatch-ttl-test", state_ttl_s=6.0,
                        state_write_s=2.0)
    with Stack(settings, embedded=True, port=free_port()) as stack:
        yield stack


def _latest(bootstrap: str, topic: str, keys: set[bytes], until, timeout_s: float = 30.0) -> dict[bytes, bytes | None]:
    """The newest value of each of ``keys`` on ``topic`` (None: a tombstone), once ``until`` holds for them."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50,
                             auto_offset_reset="earliest")
    latest: dict[bytes, bytes | None] = {}
    deadline = time.monotonic() + timeout_s
    try:
        consumer.subscribe([topic])
        while time.monotonic() < deadline and not (keys <= latest.keys() and until(latest)):
            for records in consumer.poll(timeout_ms=200).values():
                latest.update({r.key: r.value for r in records if r.key in keys})
    finally:
        consumer.close()
    return latest


@pytest.mark.broker
def test_a_silent_rank_and_run_lose_their_state_after_the_ttl_and_a_rank_that_returns_starts_afresh(
        forgetful_stack, run_id):
    bootstrap, app_id = forgetful_stack.bootstrap, forgetful_stack.settings.app_id
    nan = TelemetryBatch(run=run_id, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                         series={"loss": Series(np.arange(3), np.array([1.0, 1.1, float("nan")]))})
    firing = lambda a: a["run"] == run_id and a["metric"] == "loss" and a["status"] == "firing"  # noqa: E731
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        producer.send(contract.TELEMETRY, nan.to_bytes(), key=nan.key)
        producer.flush()
        assert consume_json(bootstrap, contract.ALERTS, firing)

        gone = lambda latest: all(v is None for v in latest.values())  # noqa: E731
        ranks = _latest(bootstrap, f"{app_id}-rank-state-changelog", {nan.key}, gone)
        runs = _latest(bootstrap, f"{app_id}-run-watch-changelog", {run_id.encode()}, gone)
        assert ranks == {nan.key: None} and runs == {run_id.encode(): None}, (ranks.keys(), runs.keys())

        # The same message again: a worker that still held the rank's state would drop it as a replay.
        producer.send(contract.TELEMETRY, nan.to_bytes(), key=nan.key)
        producer.flush()
    finally:
        producer.close()
    assert len(consume_json(bootstrap, contract.ALERTS, firing, count=2, timeout_s=30)) == 2

"""Alert engine semantics on the real broker: grouping across ranks, no duplicates across a crash."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
from conftest import consume_json
from faust.types import TP
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.stack import Stack
from rankwatch.stream_processors import tansu

pytestmark = pytest.mark.broker


def _batch(run: str, rank: int, seq: int, metric: str, values, world: int, first_step: int = 0) -> TelemetryBatch:
    values = np.asarray(values, dtype=np.float64)
    return TelemetryBatch(run=run, rank=rank, world_size=world, producer="p", seq=seq, ts=time.time(),
                          series={metric: Series(np.arange(first_step, first_step + len(values)), values)})


def _send(bootstrap: str, *batches: TelemetryBatch) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for b in batches:
        producer.send(contract.TELEMETRY, b.to_bytes(), key=b.key)
    producer.flush()
    producer.close()


def _is(run: str, metric: str):
    return lambda a: a["run"] == run and a["metric"] == metric and a["status"] == "firing"


def test_eight_ranks_going_nan_at_one_step_is_one_alert(bootstrap, run_id):
    world = 8
    values = [1.0] * 120 + [float("nan")]
    _send(bootstrap, *[_batch(run_id, r, 0, "loss", values, world) for r in range(world)])
    [alert] = consume_json(bootstrap, contract.ALERTS, _is(run_id, "loss"))
    assert alert["ranks"] == list(range(world)) and alert["rank"] is None
    assert (alert["step"], alert["incident"], alert["key"]) == (120, 120, f"{run_id}/nonfinite/loss")

    # Steps apart, so that the marker does not join the NaN's page (``grouping.PAGE_STEPS``).
    _send(bootstrap, _batch(run_id, 0, 1, "marker", [float("inf")], world, first_step=130))
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "marker")), "the marker behind it never alerted"
    assert len(consume_json(bootstrap, contract.ALERTS, _is(run_id, "loss"), count=2, timeout_s=2)) == 1


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("crash")), app_id="rankwatch-crash-test")
    with Stack(settings, embedded=True, port=free_port()) as stack:
        yield stack


def test_a_crashed_worker_loses_no_alert_and_repeats_only_the_same_transition(own_stack, run_id):
    bootstrap = own_stack.bootstrap
    nan = _batch(run_id, 1, 0, "loss", [1.0, 2.0, float("nan")], world=2)
    _send(bootstrap, nan)
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "loss")), "no alert before the crash"

    for worker in own_stack.workers:
        worker.proc.kill()  # no commit, no goodbye: a crash
        worker.proc.wait()
    own_stack.start_workers()

    # At-least-once: the same message again (a producer retry), then a marker behind it.
    _send(bootstrap, nan, _batch(run_id, 1, 1, "marker", [float("nan")], world=2, first_step=10))
    # Without the marker's alert the count below proves nothing: a worker that processes nothing passes it.
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "marker"), timeout_s=60), \
        "the restarted worker is silent"
    alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["metric"] == "loss",
                          count=10, timeout_s=2)
    # At least once: a worker killed after sending an alert but before its changelog write sends it
    # again, as the same transition, which readers drop by (key, status, incident, ranks).
    assert {(a["key"], a["status"], a["incident"], tuple(a["ranks"])) for a in alerts} == {
        (alerts[0]["key"], "firing", alerts[0]["incident"], tuple(alerts[0]["ranks"]))}, alerts


def _changelog(bootstrap: str, topic: str, keys: set[bytes], timeout_s: float = 60.0,
               ready=lambda value: True) -> dict[bytes, tuple[int, bytes]]:
    """The newest ``ready`` record of each of ``keys`` on ``topic``: key -> (partition, value), once all are
    there. State is written every few seconds, so an early record may hold only part of what was sent."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50,
                             auto_offset_reset="earliest", max_partition_fetch_bytes=4 << 20)
    found: dict[bytes, tuple[int, bytes]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        consumer.subscribe([topic])
        while time.monotonic() < deadline and not keys <= found.keys():
            for records in consumer.poll(timeout_ms=200).values():
                found.update({r.key: (r.partition, r.value) for r in records if r.key in keys and ready(r.value)})
    finally:
        consumer.close()
    return found


def _committed(bootstrap: str, group: str, topic: str, timeout_s: float = 30.0) -> bool:
    """Whether ``group`` commits every partition of ``topic`` up to its end within ``timeout_s``."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    deadline = time.monotonic() + timeout_s
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        # Tansu's ListOffsets answers low (its quirk 4): a commit short of the end would pass for it.
        reported = {TP(tp.topic, tp.partition): offset for tp, offset in consumer.end_offsets(tps).items()}
        ends = asyncio.run(tansu.true_end_offsets(bootstrap, reported))
        while tps and time.monotonic() < deadline:
            if all((consumer.committed(tp) or 0) >= ends[TP(tp.topic, tp.partition)] for tp in tps):
                return True
            time.sleep(0.2)
        return False
    finally:
        consumer.close()


def test_a_worker_stopped_cleanly_writes_every_rank_state_and_commits_every_message(own_stack, run_id):
    """A rank's state is written every few seconds and the messages it records are acknowledged only
    then; a clean stop (SIGTERM) must write what is pending, or a restart replays it and repeats alerts."""
    bootstrap, app_id = own_stack.bootstrap, own_stack.settings.app_id
    first = _batch(run_id, 0, 0, "a", [1.0, float("nan")], world=1)
    _send(bootstrap, first)
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "a"))  # applied, its state written at once
    # Within the write interval of the first: applied, its state and ack held until the next write.
    _send(bootstrap, _batch(run_id, 0, 1, "b", [1.0, float("nan")], world=1, first_step=2))
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "b"))
    for worker in own_stack.workers:
        worker.stop()
    try:
        assert all(w.proc.returncode == 0 for w in own_stack.workers), [list(w.tail)[-30:] for w in own_stack.workers]
        stored = _changelog(bootstrap, f"{app_id}-rank-state-changelog", {first.key})
        assert msgpack.unpackb(stored[first.key][1], strict_map_key=False)["seq"] == 1, "the last state was not written"
        assert _committed(bootstrap, app_id, contract.TELEMETRY, timeout_s=2), "a stopped worker left messages to replay"
    finally:
        own_stack.start_workers()


def test_a_restarted_worker_judges_stragglers_with_what_the_run_learned_before(own_stack, run_id):
    """The run's cross-rank state is stored and read back after a crash: five straggling steps are
    too few for a fresh detector (it warms up on ten), so the alert proves the baselines came back."""
    bootstrap, world = own_stack.bootstrap, 4
    rng = np.random.default_rng(5)

    def steps(first: int, n: int, slow_rank: int | None = None) -> list[TelemetryBatch]:
        return [_batch(run_id, rank, first, "compute_time_s",
                       0.1 + 0.001 * rng.standard_normal(n) + (0.2 if rank == slow_rank else 0.0), world, first)
                for rank in range(world)]

    _send(bootstrap, *steps(0, 30))
    key = run_id.encode()

    def learned(value: bytes) -> bool:
        track = value and msgpack.unpackb(value, strict_map_key=False)["tracks"].get("compute_time_s")
        return bool(track) and track["detector"]["steps"] >= 20

    assert _changelog(bootstrap, f"{own_stack.settings.app_id}-run-watch-changelog", {key}, ready=learned), \
        "the run's watch was never stored with 20 steps learned"

    # Only once the worker has committed its place: a replay of the first 30 steps would warm up a
    # fresh detector too, and the alert would prove nothing.
    assert _committed(bootstrap, own_stack.settings.app_id, contract.RUN_EVENTS), "run events never committed"
    for worker in own_stack.workers:
        worker.proc.kill()
        worker.proc.wait()
    own_stack.start_workers()

    _send(bootstrap, *steps(30, 5, slow_rank=2))
    alerts = consume_json(bootstrap, contract.ALERTS,
                          lambda a: a["run"] == run_id and a["metric"] == "compute_time_s" and a["status"] == "firing",
                          timeout_s=60)
    assert alerts and alerts[0]["ranks"] == [2], alerts


def test_a_rank_state_over_a_records_limit_is_stored_in_pieces_and_read_back_after_a_crash(own_stack, run_id):
    """A rank logging 2,000 metrics has 2.6-3.6 MB of state, over the 1 MiB Kafka takes in a record;
    writing it once stopped the whole worker. It is stored in pieces on the key's partition, and a
    restarted worker reads them back: it knows seq 0 as applied, and drops a message that claims it."""
    bootstrap = own_stack.bootstrap
    values = {f"layer{i:04d}/loss": [1.0, 1.1, 1.2] for i in range(2000)}
    values["layer0000/loss"] = [1.0, 1.1, float("nan")]
    wide = TelemetryBatch(run=run_id, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                          series={m: Series(np.arange(3), np.array(v)) for m, v in values.items()})
    nan_alert = _is(run_id, "layer0000/loss")
    _send(bootstrap, wide)
    assert consume_json(bootstrap, contract.ALERTS, nan_alert, timeout_s=60)

    key, changelog = wide.key, f"{own_stack.settings.app_id}-rank-state-changelog"
    partition, index = _changelog(bootstrap, changelog, {key})[key]
    count = msgpack.unpackb(index)["__pieces__"]
    pieces = _changelog(bootstrap, changelog, {key + b"\0#%d" % i for i in range(count)})
    assert count >= 3 and len(pieces) == count, pieces.keys()
    assert {p for p, _ in pieces.values()} == {partition}  # recovered with the key
    assert _committed(bootstrap, own_stack.settings.app_id, contract.TELEMETRY), "telemetry never committed"
    for worker in own_stack.workers:
        worker.proc.kill()
        worker.proc.wait()
    own_stack.start_workers()

    # Seq 0 again, with a NaN of its own: a worker that lost the state would apply it and alert.
    # Steps apart, so that neither joins another's page.
    probe = _batch(run_id, 0, 0, "layer0001/loss", [1.0, 1.1, float("nan")], world=1, first_step=10)
    _send(bootstrap, probe, _batch(run_id, 0, 1, "marker", [float("nan")], world=1, first_step=20))
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "marker"), timeout_s=60), "the restarted worker is silent"
    assert not consume_json(bootstrap, contract.ALERTS,
                            lambda a: a["run"] == run_id and "layer0001/loss" in [a["metric"], *a.get("metrics", [])],
                            timeout_s=2)

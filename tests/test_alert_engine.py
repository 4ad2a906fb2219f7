"""Alert engine semantics on the real broker: grouping across ranks, no duplicates across a crash."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import consume_json
from kafka import KafkaProducer

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.stack import Stack

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

    _send(bootstrap, _batch(run_id, 0, 1, "marker", [float("inf")], world, first_step=121))
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
    _send(bootstrap, nan, _batch(run_id, 1, 1, "marker", [float("nan")], world=2, first_step=3))
    # Without the marker's alert the count below proves nothing: a worker that processes nothing passes it.
    assert consume_json(bootstrap, contract.ALERTS, _is(run_id, "marker"), timeout_s=60), \
        "the restarted worker is silent"
    alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["metric"] == "loss",
                          count=10, timeout_s=2)
    # At least once: a worker killed after sending an alert but before its changelog write sends it
    # again, as the same transition, which readers drop by (key, status, incident, ranks).
    assert {(a["key"], a["status"], a["incident"], tuple(a["ranks"])) for a in alerts} == {
        (alerts[0]["key"], "firing", alerts[0]["incident"], tuple(alerts[0]["ranks"]))}, alerts

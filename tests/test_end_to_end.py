"""The whole loop on a real broker (Tansu and Apache Kafka): ranks -> telemetry -> Faust worker -> alerts."""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import consume_json
from kafka import KafkaProducer

from rankwatch.producers import RankPublisher, TrainerHook
from rankwatch import contract
from rankwatch.contract import Series, TelemetryBatch

pytestmark = [pytest.mark.broker, pytest.mark.both_brokers]
HERE = Path(__file__).parent

ALERT_FIELDS = {
    "schema": int, "key": str, "run": str, "status": str, "severity": str, "detector": str,
    "metric": str, "step": int, "message": str, "ts": float,
}


def _batch(run: str, rank: int, seq: int, values, *, metric="loss", first_step=0, producer="p") -> TelemetryBatch:
    values = np.asarray(values, dtype=np.float64)
    steps = np.arange(first_step, first_step + len(values))
    return TelemetryBatch(run=run, rank=rank, world_size=4, producer=producer, seq=seq, ts=time.time(),
                          series={metric: Series(steps, values)})


def _send(bootstrap: str, *payloads: tuple[bytes, bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for key, value in payloads:
        producer.send(contract.TELEMETRY, value, key=key)
    producer.flush()
    producer.close()


def test_nan_on_one_rank_alerts_with_contract_fields(bootstrap, run_id):
    world, nan_rank, nan_step = 3, 1, 30
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "rank_loop.py"), run_id, bootstrap, "40", str(nan_step)],
            env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), NAN_RANK=str(nan_rank)),
        )
        for r in range(world)
    ]
    assert [p.wait(120) for p in procs] == [0] * world

    [alert] = consume_json(
        bootstrap, contract.ALERTS,
        lambda a: a["run"] == run_id and a["metric"] == "loss" and a["detector"] == "nonfinite",
    )
    for name, kind in ALERT_FIELDS.items():
        assert isinstance(alert[name], kind), (name, alert)
    assert alert["schema"] == contract.SCHEMA_VERSION
    assert (alert["status"], alert["severity"], alert["rank"], alert["step"]) == ("firing", "critical", nan_rank, nan_step)
    assert alert["value"] == "NaN" and math.isnan(float(alert["value"]))
    assert alert["key"] == f"{run_id}/nonfinite/loss" and alert["ranks"] == [nan_rank]
    assert abs(alert["ts"] - time.time()) < 300


def test_malformed_bytes_are_dead_lettered_and_the_next_event_still_alerts(bootstrap, run_id):
    key = contract.telemetry_key(run_id, 0)
    garbage = b"\xff\x00 definitely not json"
    _send(bootstrap, (key, garbage), (key, _batch(run_id, 0, 0, [1.0, float("inf")]).to_bytes()))

    [letter] = consume_json(
        bootstrap, contract.DEADLETTER, lambda d: base64.b64decode(d["payload_b64"]) == garbage
    )
    assert letter["topic"] == contract.TELEMETRY and "not UTF-8 JSON" in letter["reason"]
    [alert] = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id)
    assert (alert["step"], alert["value"]) == (1, "Infinity")


def test_schema_violation_is_dead_lettered_with_its_reason(bootstrap, run_id):
    bad = json.dumps({"schema": 1, "kind": "telemetry", "run": run_id, "rank": 7, "world_size": 4,
                      "producer": "p", "seq": 0, "ts": 0, "series": {}}).encode()
    _send(bootstrap, (contract.telemetry_key(run_id, 7), bad))
    [letter] = consume_json(bootstrap, contract.DEADLETTER, lambda d: base64.b64decode(d["payload_b64"]) == bad)
    assert "rank 7 outside world_size 4" in letter["reason"]


def test_replayed_batches_change_no_alert(bootstrap, run_id):
    key = contract.telemetry_key(run_id, 2)
    nan = _batch(run_id, 2, 0, [1.0, float("nan")]).to_bytes()
    # The same message three times (a producer retry, a rebalance replay), then a marker batch.
    # Steps apart, so that the marker does not join the NaN's page (``grouping.PAGE_STEPS``).
    marker = _batch(run_id, 2, 1, [float("nan")], metric="marker", first_step=10).to_bytes()
    _send(bootstrap, (key, nan), (key, nan), (key, nan), (key, marker))

    assert consume_json(
        bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["metric"] == "marker",
    ), "nothing arrived"
    # Same partition, so the duplicates were processed before the marker's alert was sent.
    loss_alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id and a["metric"] == "loss",
                               count=2, timeout_s=3)
    assert len(loss_alerts) == 1


def test_closed_step_windows_are_rolled_up_to_reports(bootstrap, run_id):
    values = np.arange(25, dtype=np.float64)  # session rollup window: 10 steps
    _send(bootstrap, (contract.telemetry_key(run_id, 3), _batch(run_id, 3, 0, values).to_bytes()))
    rollups = consume_json(bootstrap, contract.REPORTS, lambda r: r.get("run") == run_id, count=2)
    by_start = {r["start_step"]: r for r in rollups}
    assert sorted(by_start) == [0, 10]
    assert by_start[10]["count"] == 10 and by_start[10]["mean"] == pytest.approx(values[10:20].mean())
    assert by_start[10]["std"] == pytest.approx(values[10:20].std(ddof=1))
    assert (by_start[0]["min"], by_start[0]["max"]) == (0.0, 9.0)


def test_a_message_that_comes_after_a_later_one_is_still_rolled_up(bootstrap, run_id):
    # What a worker sees when Faust skips a record and the partition is read again (docs/operations.md).
    key = contract.telemetry_key(run_id, 1)
    batches = [_batch(run_id, 1, seq, np.full(10, float(seq)), first_step=10 * seq).to_bytes() for seq in range(4)]
    # seq 0 after seq 1, then once more as a replay; seq 3 closes window 20 after all of that.
    _send(bootstrap, *((key, batches[seq]) for seq in (1, 0, 2, 0, 3)))
    rollups = consume_json(bootstrap, contract.REPORTS, lambda r: r.get("run") == run_id,
                           until=lambda found: any(r["start_step"] == 20 for r in found))
    assert sorted((r["start_step"], r["count"], r["mean"]) for r in rollups) == [
        (0, 10, 0.0), (10, 10, 1.0), (20, 10, 2.0)]


def test_an_earlier_incarnations_messages_read_again_after_the_rank_restarted_change_nothing(bootstrap, run_id):
    # A worker that reads a partition again from its committed offset (docs/operations.md) meets the
    # messages of a rank's incarnation "a" after those of the restarted "b": a replay, not a new rank.
    key = contract.telemetry_key(run_id, 1)
    a0 = _batch(run_id, 1, 0, [100.0] * 20, producer="a").to_bytes()
    b = [_batch(run_id, 1, seq, values, first_step=20 + 20 * seq, producer="b").to_bytes()
         for seq, values in enumerate([[1.0] * 20, [1.0] * 5 + [float("nan")] + [1.0] * 4])]
    _send(bootstrap, (key, a0), (key, b[0]), (key, a0), (key, b[1]))
    alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id,
                          until=lambda found: any(a["detector"] == "nonfinite" for a in found))
    # Taken for a new incarnation, a0's loss of 100 after b's 1.0 was a hundredfold explosion.
    assert [(a["detector"], a["status"], a["incident"]) for a in alerts] == [("nonfinite", "firing", 45)]


def test_a_nan_on_the_urgent_lane_pages_alone_and_stage_one_only_replays_it(bootstrap, run_id):
    # Ranks 0, 2 and 3 never report, and rank 1's telemetry comes only after the page: a worker far
    # behind on telemetry. The lane's message alone must page.
    lane = contract.UrgentTelemetry(**vars(_batch(run_id, 1, 0, [float("nan")], first_step=30)))
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(contract.URGENT, lane.to_bytes(binary=True), key=lane.key)
    producer.flush()
    [page] = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id)
    assert (page["status"], page["detector"], page["ranks"], page["step"]) == ("firing", "nonfinite", [1], 30)

    key = contract.telemetry_key(run_id, 1)
    _send(bootstrap, (key, _batch(run_id, 1, 0, [1.0] * 20 + [float("nan")], first_step=10).to_bytes()),
          (key, _batch(run_id, 1, 1, [1.0] * 5, first_step=31).to_bytes()))
    alerts = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id,
                          until=lambda found: any(a["status"] == "resolved" for a in found))
    # Stage 1's firing for the same NaN went to stage 2 before its resolution did: it was dropped as a replay.
    assert [(a["status"], a["incident"]) for a in alerts] == [("firing", 30), ("resolved", 30)]


def test_nan_in_two_metrics_of_one_message_is_one_page_from_its_first_send(bootstrap, run_id):
    # A client without the NaN lane (the documented format, straight to the topic) sends one message
    # in which grad norm and loss turn NaN at step 30. Stage 1's two signals travel as one event
    # (``signal_batch``) and stage 2 applies them together: the first alert lists both metrics, where
    # applied one by one the grad norm was paged alone and the loss joined in an update.
    steps, values = np.arange(10, 31), np.array([1.0] * 20 + [float("nan")])
    batch = TelemetryBatch(run=run_id, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                           series={m: Series(steps, values) for m in ("grad_norm", "loss")})
    _send(bootstrap, (batch.key, batch.to_bytes()))
    [page] = consume_json(bootstrap, contract.ALERTS, lambda a: a["run"] == run_id)
    assert (page["status"], page["detector"], page["ranks"], page["step"]) == ("firing", "nonfinite", [0], 30)
    assert page["metrics"] == ["grad_norm", "loss"]


def test_the_publisher_sends_a_metrics_first_nan_on_the_lane_once_per_change(bootstrap, run_id):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    for step, loss in enumerate([1.0, 1.0, float("nan"), float("nan"), 1.0, float("inf"), float("nan")]):
        publisher.log({"loss": loss, "lr": 0.1}, step)
    assert publisher.flush(timeout_s=60)
    publisher.close()
    lane = consume_json(bootstrap, contract.URGENT, lambda b: b.get("run") == run_id, count=3, timeout_s=5)
    assert all(list(b["series"]) == ["loss"] for b in lane)
    # Each NaN or infinity that follows finite points; the second one after the calm since the first.
    points = [point for b in lane for point in zip(b["series"]["loss"]["steps"], b["series"]["loss"]["values"])]
    assert points == [(2, "NaN"), (4, 1.0), (5, "Infinity")]


def test_hook_publishes_the_grad_norm_clip_grad_norm_computes(bootstrap, run_id):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap)
    hook = TrainerHook(model, opt, publisher, every=1)
    expected = {}
    for step in range(5):
        loss = model(torch.randn(32, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        expected[step] = (loss.item(), torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        hook.set_loss(loss)
        opt.step()
    publisher.close()

    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=1)
    got = {}
    for batch in batches:
        series = batch["series"]
        if "loss" not in series:
            continue  # a heartbeat
        for step, loss, norm in zip(series["loss"]["steps"], series["loss"]["values"], series["grad_norm"]["values"]):
            got[step] = (loss, norm)
    assert sorted(got) == list(range(5))
    for step, (loss, norm) in expected.items():
        assert got[step] == pytest.approx((loss, norm), rel=1e-6)


def test_log_without_a_broker_returns_at_once_and_never_raises():
    from rankwatch.broker import free_port

    publisher = RankPublisher(run="nobroker", rank=0, world_size=1, bootstrap=f"127.0.0.1:{free_port()}",
                              connect_timeout_s=60, drain_s=0)
    started = time.perf_counter()
    for step in range(10_000):
        publisher.log({"loss": 1.0, "grad_norm": 2.0}, step)
    elapsed = time.perf_counter() - started
    publisher.close(timeout_s=2)
    stats = publisher.stats()
    # A log() that waited on the broker would wait out the 60 s connect timeout at least once;
    # the margin is wide so a loaded machine cannot fail it.
    assert elapsed < 30, elapsed
    assert stats.logged == 10_000 and stats.sent == 0 and stats.failed == stats.dropped == 0
    assert stats.spooled > 0  # nothing lost: it waits in the spool for a broker

"""RankPublisher: bounded queue, value conversion, identity from the environment, heartbeats, samplers."""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
import pytest
import torch
from conftest import consume_json, sharing_a_cpu

from rankwatch.producers import publisher as publisher_module
from rankwatch.producers.collectives import CollectiveTimer, busy_time
from rankwatch.producers.grad_norms import l2
from rankwatch.producers.identity import rank_identity
from rankwatch.producers.publisher import RankPublisher
from rankwatch.producers.shipper import kafka_config
from rankwatch.producers.system import CpuWaitClock, ProcessSampler, run_delay_s
from rankwatch.producers.values import Chunk, Derived, Staged, stage
from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import HEARTBEAT


def _offline(**kwargs) -> RankPublisher:
    """A publisher whose broker is a closed port: it must still never block nor raise."""
    return RankPublisher(run="offline", rank=0, world_size=1, bootstrap=f"127.0.0.1:{free_port()}",
                         connect_timeout_s=0.2, drain_s=0, **kwargs)


def test_a_full_queue_drops_counts_and_logs_and_keeps_its_bound(caplog, monkeypatch):
    monkeypatch.setattr(publisher_module, "_POLL_S", 30.0)
    publisher = _offline(max_queue=100, linger_s=30)  # the sender sleeps through the burst
    with caplog.at_level(logging.WARNING, logger="rankwatch.producers.publisher"):
        for step in range(1000):
            publisher.log({"loss": 1.0}, step)
    stats = publisher.stats()
    assert (stats.logged, stats.dropped, stats.queued) == (100, 900, 100)
    warnings = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert len(warnings) == 10 and "512 items dropped" in warnings[-1]  # at 1, 2, 4… drops, not 900 lines
    publisher.close(timeout_s=1)
    assert publisher.stats().queued == 0


def test_values_are_read_in_bulk_and_bad_ones_rejected_by_name():
    points = [
        (0, {"f": 1.5, "i": 2, "flag": True, "np": np.float32(0.25), "t32": torch.tensor(3.0),
             "t64": torch.tensor(4.0, dtype=torch.float64), "long": torch.tensor(5), "col": torch.ones(1, 1)}),
        (1, {"text": "high", "vec": torch.ones(3), "cplx": torch.tensor(1 + 2j), "none": None, "f": float("nan"),
             "sum": Derived(sum, [torch.tensor(1.0), 2, torch.tensor(3, dtype=torch.int32)]),
             "broken": Derived(lambda v: v[0] / 0, [torch.tensor(1.0)]),
             "of_vector": Derived(sum, [torch.ones(2, 2)]), "of_text": Derived(sum, ["x"])}),
    ]
    chunk = Chunk(points, [], [])
    assert chunk.ready() and len(chunk) == 17
    got = {(step, name): value for step, name, value in chunk.resolve()}
    assert math.isnan(got.pop((1, "f")))
    assert got == {(0, "f"): 1.5, (0, "i"): 2.0, (0, "flag"): 1.0, (0, "np"): 0.25, (0, "t32"): 3.0,
                   (0, "t64"): 4.0, (0, "long"): 5.0, (0, "col"): 1.0, (1, "sum"): 6.0, (1, "of_vector"): 4.0}
    assert sorted(chunk.invalid) == ["broken", "cplx", "none", "of_text", "text", "vec"]


class _FakeCopy:
    """Stands in for a CUDA host copy (this machine has no GPU): pending until released."""

    def __init__(self, values: list[list[float]]):
        self._values, self.released = values, False

    def done(self) -> bool:
        return self.released

    def values(self) -> list[list[float]]:
        assert self.released, "read before the copy finished"
        return self._values


def test_staged_device_values_wait_for_their_copy_and_feed_derived_values():
    copy = _FakeCopy([[3.0, 4.0], [0.5]])  # per-tensor grad norms, and a loss
    norms, loss = Staged(copy, 0), Staged(copy, 1)
    chunk = Chunk([(9, {"grad_norm": Derived(l2, [norms]), "loss": loss, "lr": 0.1})], [], [])
    assert not chunk.ready()
    copy.released = True
    assert chunk.ready()
    assert chunk.resolve() == [(9, "grad_norm", 5.0), (9, "loss", 0.5), (9, "lr", 0.1)]
    assert stage({"loss": torch.tensor(1.0)})["loss"].item() == 1.0  # CPU tensors are left alone


class _Lazy:
    """A value that is not ready until released, like a device copy behind a CUDA event."""

    def __init__(self, value: float):
        self.value, self.released = value, threading.Event()

    def done(self) -> bool:
        return self.released.is_set()

    def item(self) -> float:
        return self.value


def test_identity_comes_from_the_environment_and_a_run_id_is_required():
    env = {"RANKWATCH_RUN": "exp-7", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "RANKWATCH_BOOTSTRAP": f"127.0.0.1:{free_port()}"}
    assert rank_identity(env) == (3, 4, 1)
    publisher = RankPublisher.from_env(env, connect_timeout_s=0.2, samplers=[], drain_s=0)
    try:
        assert (publisher.run, publisher.rank, publisher.world_size, publisher.local_rank) == ("exp-7", 3, 4, 1)
        assert publisher.bootstrap == env["RANKWATCH_BOOTSTRAP"]
        assert ":1:" in publisher.producer_id  # host:local_rank:pid:nonce
    finally:
        publisher.close(timeout_s=1)
    elastic = RankPublisher.from_env({"TORCHELASTIC_RUN_ID": "job-9", "RANKWATCH_BOOTSTRAP": env["RANKWATCH_BOOTSTRAP"]},
                                     connect_timeout_s=0.2, samplers=[], drain_s=0)
    elastic.close(timeout_s=1)
    assert (elastic.run, elastic.rank, elastic.world_size) == ("job-9", 0, 1)
    for missing in ({}, {"TORCHELASTIC_RUN_ID": "none"}):
        with pytest.raises(ValueError, match="RANKWATCH_RUN"):
            RankPublisher.from_env(missing)
    with pytest.raises(ValueError, match="rank"):
        RankPublisher(run="x", rank=4, world_size=4)


def test_process_sampler_reads_rss_and_cpu():
    sampler = ProcessSampler()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # burn CPU so the next reading cannot be zero
        pass
    sample = sampler()
    assert sample["rss_bytes"] > 10 * 2**20  # this interpreter with torch loaded
    assert 10 < sample["cpu_percent"] < 100 * 64


def test_the_cpu_wait_clock_counts_what_a_thread_waits_for_a_cpu_other_processes_hold():
    clock = CpuWaitClock()
    with sharing_a_cpu(hogs=2):
        first, ran, began = run_delay_s(clock.read()), time.thread_time(), time.perf_counter()
        while time.perf_counter() < began + 0.6:  # runnable throughout: three take turns on one CPU
            pass
        wall, ran = time.perf_counter() - began, time.thread_time() - ran
        waited = run_delay_s(clock.read()) - first
    clock.close()
    # Not its CPU time (about a third): the rest of the wall time, which it spent waiting.
    assert waited > 0.25 and waited == pytest.approx(wall - ran, abs=0.08), (waited, wall, ran)


def test_busy_time_is_the_union_of_spans():
    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (0.5, 1.5), (0.2, 0.3), (2.0, 2.5)]) == pytest.approx(2.0)


def test_the_wait_of_the_oldest_unfinished_collective_is_sampled_and_ends_with_it():
    timer = CollectiveTimer()
    assert timer.sample() == {contract.COLLECTIVE_WAIT: 0.0}
    first = timer.begin(torch.ones(2))
    time.sleep(0.05)
    second = timer.begin(torch.ones(2))
    assert timer.waiting_s() >= 0.05  # the oldest call counts, not the newest
    timer.end(first)
    assert timer.waiting_s() < 0.05
    timer.end(second)
    assert timer.waiting_s() == 0.0
    busy, waited = timer.take()
    assert busy >= 0.05 and waited == 0.0  # the finished spans are still the step's collective time


def test_the_cpu_wait_inside_collectives_is_the_clock_across_their_union():
    timer = CollectiveTimer()
    readings = iter([1.0, 1.25, 1.5, 2.0, 3.0, 3.0])  # the training thread's CPU wait clock, as it advances
    timer.cpu_wait = lambda: next(readings)
    first = timer.begin(None)  # 1.0
    second = timer.begin(None)  # 1.25: overlaps the first
    timer.end(first)  # 1.5
    timer.end(second)  # 2.0: the union of the two waited 2.0 - 1.0
    timer.end(timer.begin(None))  # 3.0 to 3.0: nothing
    busy, waited = timer.take()
    assert waited == pytest.approx(1.0) and busy > 0
    assert timer.take() == (0.0, 0.0)  # taken once


@pytest.mark.broker
def test_heartbeats_flow_while_a_value_waits_on_its_device_then_it_is_published(bootstrap, run_id):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, heartbeat_s=0.2)
    publisher.log({"loss": 1.0}, 0)
    stuck = _Lazy(7.0)
    publisher.log({"loss": stuck}, 1)
    publisher.log({"loss": 3.0}, 2)
    beats = consume_json(bootstrap, contract.TELEMETRY,
                         lambda b: b.get("run") == run_id and HEARTBEAT in b["series"], count=3)
    assert len(beats) == 3
    assert publisher.stats().queued == 0  # drained: the points wait in the sender, behind the lazy value
    stuck.released.set()
    publisher.close()
    stats = publisher.stats()
    assert stats.failed == 0 and stats.dropped == 0
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=stats.sent)
    losses = [(s, v) for b in sorted(batches, key=lambda b: b["seq"]) if "loss" in b["series"]
              for s, v in zip(b["series"]["loss"]["steps"], b["series"]["loss"]["values"])]
    assert losses == [(0, 1.0), (1, 7.0), (2, 3.0)]  # in order, the stuck one included
    assert all({HEARTBEAT, "rss_bytes", "cpu_percent"} <= set(b["series"]) for b in beats)  # samplers ride along
    # The points released just before close() leave in its final batch.
    last = max(batches, key=lambda b: b["seq"])
    assert [b["seq"] for b in batches if b["final"]] == [last["seq"]] and "loss" in last["series"]


@pytest.mark.broker
def test_values_that_are_not_numbers_are_skipped_and_counted(bootstrap, run_id, caplog):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    with caplog.at_level(logging.WARNING, logger="rankwatch.producers.publisher"):
        for step in range(3):
            publisher.log({"loss": float(step), "note": "warm"}, step)
        publisher.close()
    stats = publisher.stats()
    assert stats.invalid == 3 and stats.failed == 0
    assert caplog.text.count("'note'") == 1
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=stats.sent)
    series = [b["series"] for b in batches]
    assert not any("note" in s for s in series)
    assert [b["final"] for b in sorted(batches, key=lambda b: b["seq"])][-1:] == [True]  # the data batch itself
    assert "loss" in max(batches, key=lambda b: b["seq"])["series"]
    assert sorted(v for s in series if "loss" in s for v in s["loss"]["values"]) == [0.0, 1.0, 2.0]


@pytest.mark.broker
def test_points_share_a_message_until_the_linger_passes_but_a_nan_goes_at_once(bootstrap, run_id):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[],
                              linger_s=30.0, heartbeat_s=60.0)
    for step in range(5):
        publisher.log({"loss": 1.0 + step}, step)
        time.sleep(0.05)  # several sender wake-ups: the points wait together
    publisher.log({"loss": float("nan")}, 5)
    [batch] = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, timeout_s=10)
    assert batch["series"]["loss"]["steps"] == [0, 1, 2, 3, 4, 5]  # one message, long before the linger
    assert batch["series"]["loss"]["values"][-1] == "NaN"
    publisher.log({"loss": 2.0}, 6)
    assert publisher.flush(timeout_s=10)  # flush() does not wait for the linger either
    publisher.close()
    # The NaN on the lane (rankwatch.urgent), its batch, the flushed one, close()'s final heartbeat
    assert publisher.stats().sent == 4
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=3)
    last = max(batches, key=lambda b: b["seq"])
    assert last["final"] and set(last["series"]) == {HEARTBEAT}  # nothing left to send: a final heartbeat


@pytest.mark.broker
def test_producer_config_overrides_the_publishers_own_kafka_settings(bootstrap, run_id):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[],
                              producer_config={"linger_ms": 3, "acks": "all", "sasl_plain_password": "hunter2"})
    with open(f"/proc/{publisher.shipper_pid}/cmdline", "rb") as f:
        assert b"hunter2" not in f.read()  # a command line is anyone's to read; settings go by the environment
    publisher.log({"loss": 1.0}, 0)
    publisher.close()
    stats = publisher.stats()
    assert (stats.sent, stats.failed) == (1, 0)  # a duplicate keyword once failed every send
    config = kafka_config(bootstrap, 5.0, {"linger_ms": 3, "acks": "all"})
    assert (config["linger_ms"], config["acks"], config["retries"]) == (3, "all", 5)


@pytest.mark.broker
def test_deferred_points_are_built_on_the_sender_thread_in_order_and_a_failing_one_costs_only_itself(
        bootstrap, run_id, caplog):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[])
    built_on = []

    def build(step, value):
        built_on.append(threading.current_thread().name)
        if value is None:
            raise RuntimeError("no value")
        return step, {"loss": value}

    with caplog.at_level(logging.ERROR, logger="rankwatch.producers.publisher"):
        publisher.defer(build, 0, 1.0)
        publisher.log({"loss": 2.0}, 1)
        publisher.defer(build, 2, None)
        publisher.defer(build, 3, 4.0)
        publisher.close()
    stats = publisher.stats()
    assert (stats.logged, stats.dropped, stats.failed) == (4, 1, 0)
    assert "could not work out a deferred point" in caplog.text
    assert set(built_on) == {publisher._thread.name} and len(built_on) == 3
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id, count=stats.sent)
    loss = [s["loss"] for b in sorted(batches, key=lambda b: b["seq"]) if "loss" in (s := b["series"])]
    assert [(st, v) for s in loss for st, v in zip(s["steps"], s["values"])] == [(0, 1.0), (1, 2.0), (3, 4.0)]


# -- telling the user whether publishing works (the shipper's stderr is the training process's) --


@pytest.mark.broker
def test_the_shipper_says_once_when_the_broker_took_the_first_messages(bootstrap, run_id, capfd):
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap, samplers=[], linger_s=0.05)
    for step in range(3):
        publisher.log({"loss": 1.0}, step)
        assert publisher.flush()
    publisher.close()
    err = capfd.readouterr().err
    assert err.count("took the first messages") == 1 and bootstrap in err, err
    assert "failed" not in err


def test_the_shipper_warns_at_once_when_it_cannot_reach_the_broker_and_not_every_retry(capfd):
    publisher = _offline(samplers=[], linger_s=0.05)
    publisher.log({"loss": 1.0}, 0)
    deadline = time.monotonic() + 10
    while "delivery to" not in capfd.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.1)
    assert time.monotonic() < deadline, "no warning within 10 s"
    time.sleep(2.0)  # several retries of the same failure
    publisher.close(timeout_s=2)
    err = capfd.readouterr().err
    assert "delivery to" not in err, err
    assert "took the first messages" not in err


def test_a_lasting_delivery_failure_is_said_again_after_growing_gaps(tmp_path, monkeypatch, caplog):
    from rankwatch.producers import shipper as shipper_module

    monkeypatch.setattr(shipper_module, "_REMIND_S", 0.1)
    shipper = shipper_module.Shipper(tmp_path, {"bootstrap_servers": "127.0.0.1:1"})
    said = []
    began = time.monotonic()
    while time.monotonic() - began < 0.8:
        caplog.clear()
        shipper._report(OSError("connection refused"))
        if caplog.records:
            said.append(time.monotonic() - began)
        time.sleep(0.01)
    gaps = [b - a for a, b in zip(said, said[1:])]
    assert said[0] < 0.05 and 2 <= len(gaps) <= 3, said  # at 0, ~0.1, ~0.3, (~0.7)
    assert gaps == sorted(gaps) and gaps[0] >= 0.1, gaps

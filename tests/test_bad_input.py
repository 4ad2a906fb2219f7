"""Bad input on the real broker (issue 15): every poison message is dead-lettered with a reason, the
worker stays up, and the next NaN still alerts. Each cause is first reproduced with one message."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import random
import time

import numpy as np
import pytest
from conftest import TEST_RULES, consume_json
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.contract import EvalShard, Series, TelemetryBatch
from rankwatch.settings import Settings
from rankwatch.sinks import read_topic
from rankwatch.stack import Stack

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    # Its own worker: a test that crashed it must not pass or fail the others.
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("bad-input")), app_id="rankwatch-bad-input-test",
                        rules=str(TEST_RULES))
    with Stack(settings, embedded=True, port=free_port()) as stack:
        yield stack


def _send(bootstrap: str, topic: str, *messages: tuple[bytes, bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, max_request_size=16 << 20, linger_ms=20,
                             batch_size=1 << 20)
    for key, value in messages:
        producer.send(topic, value, key=key)
    producer.flush()
    producer.close()


def _letters(bootstrap: str, prefix: bytes, count: int, timeout_s: float = 20.0) -> dict[tuple, dict]:
    """Dead letters whose Kafka key starts with ``prefix``, by (topic, partition, offset) of the original
    message (a redelivered one counts once), once ``count`` are there or at the timeout."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50,
                             max_partition_fetch_bytes=4 << 20)
    found: dict[tuple, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not (partitions := consumer.partitions_for_topic(contract.DEADLETTER)) and time.monotonic() < deadline:
            time.sleep(0.2)
        tps = [TopicPartition(contract.DEADLETTER, p) for p in partitions or ()]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while tps and len(found) < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    if (record.key or b"").startswith(prefix):
                        letter = json.loads(record.value)
                        found[letter["topic"], letter["partition"], letter["offset"]] = letter
        return found
    finally:
        consumer.close()


def _telemetry(run: str, **changes) -> bytes:
    """A telemetry message as another client might write it: bare NaN tokens allowed."""
    obj = {"schema": 1, "kind": "telemetry", "run": run, "rank": 0, "world_size": 1, "producer": "p", "seq": 0,
           "ts": time.time(), "series": {"loss": {"steps": [0, 1], "values": [1.0, 2.0]}}}
    obj.update(changes)
    return json.dumps(obj, allow_nan=True).encode()


def _series(steps, values) -> dict:
    return {"loss": {"steps": steps, "values": values}}


def _marker_alerts(bootstrap: str, run: str, seq: int = 1) -> list[dict]:
    """Send a NaN on the poison's partition (same key), behind it; the alerts it raised."""
    batch = TelemetryBatch(run=run, rank=0, world_size=1, producer="p", seq=seq, ts=time.time(),
                           series={"marker": Series(np.array([5]), np.array([math.nan]))})
    _send(bootstrap, contract.TELEMETRY, (batch.key, batch.to_bytes()))
    return consume_json(bootstrap, contract.ALERTS, lambda a: a.get("run") == run and a.get("metric") == "marker",
                        timeout_s=30)


POISON = {  # name: (message for run id r, what its dead letter's reason says)
    "deep nesting": (lambda r: _telemetry(r)[:-1] + b',"deep":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                     "nested too deeply"),
    "step beyond int64": (lambda r: _telemetry(r, series=_series([2**63], [1.0])), "int64"),
    "400-digit value": (lambda r: _telemetry(r, series=_series([0], [10**400])), "out of range"),
    "lone surrogate in run": (lambda r: _telemetry(r + "\ud800"), "lone surrogate"),
    "bare NaN token in ts": (lambda r: _telemetry(r, ts=math.nan), "bare NaN token"),
    "bare NaN token in values": (lambda r: _telemetry(r, series=_series([0], [math.nan])), "bare NaN token"),
    "bare Infinity token in values": (lambda r: _telemetry(r, series=_series([0], [math.inf])), "bare Infinity"),
}


@pytest.mark.parametrize("name", POISON)
def test_one_poison_message_is_dead_lettered_and_the_next_nan_alerts(own_stack, run_id, name):
    make, reason = POISON[name]
    key = contract.telemetry_key(run_id, 0)
    _send(own_stack.bootstrap, contract.TELEMETRY, (key, make(run_id)))
    letters = list(_letters(own_stack.bootstrap, key, count=1).values())
    assert len(letters) == 1 and reason in letters[0]["reason"], letters
    assert letters[0]["reason"].startswith("invalid telemetry: ")
    assert len(_marker_alerts(own_stack.bootstrap, run_id)) == 1
    assert own_stack.workers[0].proc.poll() is None


def test_an_undecodable_message_near_the_limit_is_dead_lettered_truncated(own_stack, run_id):
    key = contract.telemetry_key(run_id, 0)
    garbage = random.Random(1).randbytes(800_000)  # its base64 alone would be over 1 MB
    _send(own_stack.bootstrap, contract.TELEMETRY, (key, garbage))
    [letter] = _letters(own_stack.bootstrap, key, count=1).values()
    assert "not UTF-8 JSON" in letter["reason"]
    assert letter["truncated"] and letter["payload_size"] == len(garbage)
    assert letter["payload_sha256"] == hashlib.sha256(garbage).hexdigest()
    assert garbage.startswith(base64.b64decode(letter["payload_b64"]))
    assert len(_marker_alerts(own_stack.bootstrap, run_id)) == 1


def test_a_valid_message_over_the_size_limit_is_dead_lettered_undecoded(own_stack, run_id):
    n = 150_000  # ~3.5 MB of schema-valid telemetry
    big = TelemetryBatch(run=run_id, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                         series={"loss": Series(np.arange(n), np.random.default_rng(0).random(n))})
    data = big.to_bytes()
    assert len(data) > 3_000_000
    _send(own_stack.bootstrap, contract.TELEMETRY, (big.key, data))
    [letter] = _letters(own_stack.bootstrap, big.key, count=1).values()
    assert letter["reason"].startswith("oversized telemetry: ") and "over the limit" in letter["reason"]
    assert letter["payload_size"] == len(data) and letter["truncated"]
    assert len(_marker_alerts(own_stack.bootstrap, run_id)) == 1


def test_a_poison_eval_shard_is_dead_lettered_and_the_next_one_is_read(own_stack, run_id):
    shard = EvalShard(run=run_id, eval_id="e", step=1, rank=0, world_size=1, chunk=0, last=True,
                      sample_ids=np.arange(2), metrics={"correct": np.ones(2)}, ts=time.time())
    poison = json.dumps(json.loads(shard.to_bytes()) | {"run": run_id + "\ud800"}).encode()
    wrong_rank = json.dumps(json.loads(shard.to_bytes()) | {"rank": 3}).encode()
    key = f"{run_id}/e".encode()
    _send(own_stack.bootstrap, contract.EVAL_SHARDS, (key, poison), (key, wrong_rank))
    letters = sorted(_letters(own_stack.bootstrap, key, count=2).values(), key=lambda d: d["offset"])
    assert [d["reason"].split(": ")[0] for d in letters] == ["invalid eval shard"] * 2, letters
    assert "lone surrogate" in letters[0]["reason"] and "rank 3 outside world_size 1" in letters[1]["reason"]
    assert own_stack.workers[0].proc.poll() is None


def _flood(run: str, rng: random.Random) -> list[tuple[str, bytes, bytes]]:
    """10,000 messages no decoder may accept: malformed, truncated, oversized, wrong-version and
    wrong-type, about a tenth of them eval shards; (topic, key, value)."""
    good = json.loads(_telemetry(run))
    shard = json.loads(EvalShard(run=run, eval_id="e", step=1, rank=0, world_size=1, chunk=0, last=True,
                                 sample_ids=np.arange(3), metrics={"correct": np.ones(3)}, ts=1.0).to_bytes())
    wrong = {  # per field, values its decoder must refuse
        "run": [5, None, []], "rank": ["0", 1.5, -1, 2**63], "world_size": ["1", 0], "producer": [1],
        "seq": ["0", 1.5, 2**64], "ts": ["now", None, math.nan, 10**400], "final": ["yes"],
        "series": [[], "x", {"loss": []}, _series([0], []), _series(["a"], [1.0]), _series([0], [[1.0]])],
        "eval_id": [None], "step": ["1"], "chunk": [None], "last": [1], "sample_ids": [[1.5], "x", [2**63]],
        "metrics": [[], {"correct": [1.0]}, {"correct": ["x", 1, 1]}], "dataset_size": ["3"],
    }

    def one(i: int, base: dict, kind: int) -> bytes:
        obj = json.loads(json.dumps(base))
        if kind == 0:  # malformed
            return rng.choice([rng.randbytes(rng.randrange(200)), b"", b"{", b"[]", b"null", b'"x"', b"1e999",
                               b"\xff\xfe{}", b"[" * 3000 + b"]" * 3000, b"{" + b'"a":{' * 2000 + b"}" * 2001])
        if kind == 1:  # truncated
            data = json.dumps(obj).encode()
            return data[:rng.randrange(len(data) - 1)]
        if kind == 2:  # wrong version
            obj["schema"] = rng.choice([0, 2, "1", None, 1.0])
        elif kind == 3:  # wrong kind
            obj["kind"] = rng.choice(["alert", "eval_shard" if base is good else "telemetry", None, 1])
        else:  # a wrong type in one field
            name = rng.choice([n for n in obj if n in wrong])
            obj[name] = rng.choice(wrong[name])
        return json.dumps(obj, allow_nan=True).encode()

    messages = []
    for i in range(9_994):
        topic, base = (contract.EVAL_SHARDS, shard) if i % 10 == 0 else (contract.TELEMETRY, good)
        messages.append((topic, f"{run}/flood/{i}".encode(), one(i, base, i % 5)))
    big = TelemetryBatch(run=run, rank=0, world_size=1, producer="p", seq=0, ts=time.time(),
                         series={"loss": Series(np.arange(80_000), np.full(80_000, 0.123456789))}).to_bytes()
    for i in range(6):  # oversized: valid but over the limit, and undecodable near it (few: slow to send)
        value = big if i % 2 else rng.randbytes(900_000)
        messages.append((contract.TELEMETRY if i % 3 else contract.EVAL_SHARDS, f"{run}/flood/big{i}".encode(), value))
    rng.shuffle(messages)
    return messages


def test_ten_thousand_bad_messages_are_all_dead_lettered_and_a_nan_still_alerts(own_stack, run_id, capsys):
    from rankwatch.cli import main as cli

    messages = _flood(run_id, random.Random(15))
    assert len(messages) == 10_000
    started = time.monotonic()
    for topic in (contract.TELEMETRY, contract.EVAL_SHARDS):
        _send(own_stack.bootstrap, topic, *[(k, v) for t, k, v in messages if t == topic])

    letters = _letters(own_stack.bootstrap, f"{run_id}/flood/".encode(), count=10_000, timeout_s=60)
    took = time.monotonic() - started
    assert len(letters) == 10_000, f"{len(letters)} of 10,000 dead-lettered in {took:.0f} s"
    causes = {d["reason"].split(": ")[0] for d in letters.values()}
    assert causes <= {"invalid telemetry", "invalid eval shard", "oversized telemetry", "oversized eval shard"}, causes
    assert len(_marker_alerts(own_stack.bootstrap, run_id)) == 1
    assert own_stack.workers[0].proc.poll() is None

    # The counters: the CLI reads the topic, the worker logs its running count.
    assert cli(["deadletters", "--bootstrap", own_stack.bootstrap, "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["total"] >= 10_000 and sum(r["count"] for r in counts["by_cause"]) == counts["total"]
    assert {r["cause"] for r in counts["by_cause"]} >= causes
    deadline = time.monotonic() + 15  # the worker logs its counts every 10 s
    while time.monotonic() < deadline and not _logged_total(own_stack) >= 10_000:
        time.sleep(0.5)
    assert _logged_total(own_stack) >= 10_000, list(own_stack.workers[0].tail)[-5:]


def _logged_total(stack: Stack) -> int:
    lines = [line for line in list(stack.workers[0].tail) if "messages dead-lettered since the worker started" in line]
    return int(lines[-1].split("rankwatch: ")[1].split()[0].replace(",", "")) if lines else 0


def test_the_publisher_refuses_a_message_over_the_limit_with_one_clear_error(own_stack, run_id, caplog):
    from rankwatch.producers import RankPublisher

    def shard(eval_id: str, n: int) -> EvalShard:
        return EvalShard(run=run_id, eval_id=eval_id, step=1, rank=0, world_size=1, chunk=0, last=True,
                         sample_ids=np.arange(n), metrics={"reward": np.full(n, 0.123456789)}, ts=time.time())

    huge, small = shard("huge", 100_000), shard("small", 3)
    assert len(huge.to_bytes()) > 1_100_000  # over the broker's default limit too
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=own_stack.bootstrap)
    publisher.send(huge)
    publisher.send(small)  # must not wait behind the one that can never be sent
    assert publisher.flush(timeout_s=20)
    publisher.close(timeout_s=5)
    # Read with the contract's decoder: the topic also holds the flood test's deep nesting.
    arrived = []
    for record in read_topic(own_stack.bootstrap, contract.EVAL_SHARDS):
        with contextlib.suppress(contract.SchemaError):
            if (obj := contract.decode_any(record.value)).get("run") == run_id:
                arrived.append(obj["eval_id"])
    assert arrived == ["small"]
    assert publisher.stats().failed == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "over the limit" in r.getMessage()]
    assert len(errors) == 1 and "eval_shard" in errors[0], errors

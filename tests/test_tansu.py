"""The Tansu workarounds in rankwatch.stream_processors.tansu, each shown against the real embedded broker.

Every test pairs the workaround with the quirk it answers (numbers as in shared/notes/tansu-broker.md).
Where a test asserts the quirk itself (e.g. ListOffsets being wrong), a failure there means the broker
got fixed and the workaround can go.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiokafka
import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from rankwatch.admin import detect_flavor
from rankwatch.settings import Settings
from rankwatch.stream_processors import kafka_transport, tansu
from rankwatch.stream_processors.app import make_app

pytestmark = pytest.mark.broker


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _topic_with_multi_record_last_batch(bootstrap: str) -> tuple[str, dict[int, int]]:
    """A fresh 2-partition topic: partition 0 gets a 2-record batch, then one 5-record batch; partition 1
    stays empty. Returns the topic and each partition's true end offset (from the broker's produce acks)."""
    topic = _unique("tansu-q4")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50)
    try:
        first = [producer.send(topic, b"early-%d" % i, partition=0) for i in range(2)]
        producer.flush()
        last = [producer.send(topic, b"late-%d" % i, partition=0) for i in range(5)]  # one linger window
        producer.flush()
        offsets = [f.get(timeout=10).offset for f in first + last]
    finally:
        producer.close()
    assert offsets == list(range(7)), offsets
    return topic, {0: 7, 1: 0}


# Quirk 4: ListOffsets(LATEST) answers (base offset of the last batch + 1).


def test_true_end_offsets_corrects_list_offsets(bootstrap):
    topic, truth = _topic_with_multi_record_last_batch(bootstrap)
    tps = [aiokafka.TopicPartition(topic, p) for p in sorted(truth)]

    async def main():
        consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            reported = await consumer.end_offsets(tps)
        finally:
            await consumer.stop()
        return reported, await tansu.true_end_offsets(bootstrap, reported)

    reported, fixed = asyncio.run(main())
    # The quirk itself: if this fails, Tansu answers ListOffsets correctly now and the workaround can go.
    assert reported[tps[0]] < truth[0], f"ListOffsets looks fixed: reported {reported}, true {truth}"
    assert reported[tps[1]] == 0
    assert {tp.partition: off for tp, off in fixed.items()} == truth, f"reported {reported}"


def test_true_end_offsets_trusts_the_fetch_when_list_offsets_overstates(bootstrap):
    """A restarted broker answered ListOffsets 1 for changelog partitions a Fetch showed empty (issue 15):
    taking the larger of the two left table recovery waiting forever for an offset that never comes."""
    topic = _unique("tansu-over")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    tp = TP(topic, 0)
    fixed = asyncio.run(tansu.true_end_offsets(bootstrap, {tp: 1}))  # what the restarted broker said
    assert fixed == {tp: 0}


def test_faust_highwaters_use_true_end_offsets_on_tansu_transport(bootstrap, tmp_path):
    """Faust's table recovery asks ConsumerThread.highwaters(); the tansu thread must answer the truth,
    where the stock aiokafka thread passes the wrong ListOffsets answer through."""
    topic, truth = _topic_with_multi_record_last_batch(bootstrap)
    tps = [TP(topic, p) for p in sorted(truth)]

    async def highwaters(flavor: str) -> dict[int, int]:
        settings = Settings(bootstrap=bootstrap, data_dir=str(tmp_path / flavor), app_id=_unique(f"hw-{flavor}"))
        app = make_app(settings, flavor=flavor, partitions=8)
        thread = app.consumer._thread
        consumer = thread._create_consumer(loop=asyncio.get_running_loop())  # what on_start() does
        await consumer.start()  # no subscription: it joins no group
        thread._consumer = consumer
        try:
            return {tp.partition: off for tp, off in (await thread._highwaters(tps)).items()}
        finally:
            await consumer.stop()

    async def main():
        return await highwaters("tansu"), await highwaters("kafka")

    on_tansu_transport, on_stock_transport = asyncio.run(main())
    assert on_tansu_transport == truth
    assert on_stock_transport[0] < truth[0], f"stock highwaters look right now: {on_stock_transport}, true {truth}"


# Quirk 3: long-poll fetches are not woken by new data; Faust hard-codes fetch_max_wait_ms=1500.


def test_tansu_flavor_transport_sets_short_fetch_wait(bootstrap, tmp_path):
    async def worker_consumer_fetch_wait(flavor: str):
        settings = Settings(bootstrap=bootstrap, data_dir=str(tmp_path / flavor), app_id=_unique(f"fw-{flavor}"))
        app = make_app(settings, flavor=flavor, partitions=8)
        thread = app.consumer._thread
        consumer = thread._create_consumer(loop=asyncio.get_running_loop())  # what on_start() does
        await consumer.start()  # the fetcher is built here, from _fetch_max_wait_ms
        try:
            return type(app.transport), type(thread), consumer._fetch_max_wait_ms, consumer._fetcher._fetch_max_wait_ms
        finally:
            await consumer.stop()

    async def main():
        return await worker_consumer_fetch_wait("tansu"), await worker_consumer_fetch_wait("kafka")

    (t_transport, t_thread, t_wait, t_fetcher_wait), (k_transport, k_thread, k_wait, _) = asyncio.run(main())
    assert t_transport is tansu.Transport and t_thread is tansu.ConsumerThread
    assert t_wait == t_fetcher_wait == tansu.FETCH_MAX_WAIT_MS
    # flavor="kafka": Faust's transport (with an idempotent producer, kafka_transport), workaround inactive.
    assert k_transport is kafka_transport.Transport and issubclass(k_transport, faust_aiokafka.Transport)
    assert not issubclass(k_transport, tansu.Transport)
    assert k_thread is faust_aiokafka.AIOKafkaConsumerThread
    assert k_wait == 1500  # Faust's hard-coded value, the reason for the workaround


# Quirk 2: JoinGroup is held for half the session timeout.


def test_group_join_with_app_settings_gets_assignment(bootstrap):
    topic, group = _unique("tansu-q2"), _unique("tansu-q2-group")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        admin.close()
    ms = {k: int(v * 1000) for k, v in tansu.APP_SETTINGS.items()}

    async def main():
        consumer = aiokafka.AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            session_timeout_ms=ms["broker_session_timeout"],
            rebalance_timeout_ms=ms["broker_rebalance_timeout"],
            heartbeat_interval_ms=ms["broker_heartbeat_interval"],
        )
        started = time.monotonic()
        # start() returns once the first assignment arrives (it waits for it when subscribed).
        try:
            await asyncio.wait_for(consumer.start(), timeout=20)
            return consumer.assignment(), time.monotonic() - started
        except TimeoutError:
            return set(), time.monotonic() - started
        finally:
            await consumer.stop()

    assignment, took = asyncio.run(main())
    assert {tp.partition for tp in assignment} == {0, 1}, f"no assignment after {took:.1f}s (settings {ms})"


def test_detect_flavor_says_tansu_for_embedded_broker(bootstrap):
    assert detect_flavor(bootstrap) == "tansu"

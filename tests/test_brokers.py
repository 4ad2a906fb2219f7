"""What differs between the two brokers the suite runs on: the Tansu workarounds are on only on Tansu."""

from __future__ import annotations

import asyncio
import logging

import aiokafka
import pytest
from faust.types import TP
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from rankwatch.admin import KEPT_COUNT_LINE, connect_admin, detect_flavor, ensure_topics
from rankwatch.stack import READY_LINE
from rankwatch.stream_processors import tansu
from rankwatch.stream_processors.app import make_app
from rankwatch.stream_processors.tables import track_topic

pytestmark = [pytest.mark.broker, pytest.mark.both_brokers]


def test_the_broker_is_told_apart_and_the_worker_runs_with_its_flavor(stack, broker_kind):
    assert detect_flavor(stack.bootstrap) == broker_kind
    ready = [line for worker in stack.workers for line in worker.tail if READY_LINE in line]
    assert ready and all(f"({broker_kind})" in line for line in ready), ready


def test_the_tansu_transport_is_chosen_only_on_tansu(stack, broker_kind):
    app = make_app(stack.settings.with_(data_dir=stack.settings.data_dir + "-probe"),
                   flavor=detect_flavor(stack.bootstrap), partitions=stack.settings.partitions)
    assert isinstance(app.transport, tansu.Transport) == (broker_kind == "tansu")
    assert all(url.scheme == ("tansu" if broker_kind == "tansu" else "rankwatch-kafka") for url in app.conf.broker)
    # Apache Kafka's producer is idempotent: a batch retried after a leader's failover is not written twice.
    assert app.producer._settings_extra().get("enable_idempotence", False) == (broker_kind == "kafka")
    # Quirk 2's short session timeout is set only on Tansu; Kafka keeps Faust's default.
    assert (app.conf.broker_session_timeout == tansu.APP_SETTINGS["broker_session_timeout"]) == (broker_kind == "tansu")


def test_end_offsets_are_the_true_ones_on_kafka_and_need_the_workaround_on_tansu(bootstrap, broker_kind, run_id):
    """Quirk 4: Tansu's ListOffsets(LATEST) is (base offset of the last batch + 1); Kafka's is the end."""
    topic = f"probe-{run_id}"
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=500)
    for i in range(5):  # one batch of 5 records: linger holds them until flush
        producer.send(topic, b"x%d" % i, partition=0)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    tp = TopicPartition(topic, 0)
    try:
        reported = consumer.end_offsets([tp])[tp]
    finally:
        consumer.close()
    assert reported == (1 if broker_kind == "tansu" else 5)
    # The workaround (used by the tansu transport only) reads the Fetch high watermark: right on both.
    fixed = asyncio.run(tansu.true_end_offsets(bootstrap, {TP(topic, 0): reported}))
    assert fixed[TP(topic, 0)] == 5


def test_a_tracked_topic_stays_in_the_producers_metadata_where_a_refresh_drops_the_others(bootstrap, broker_kind,
                                                                                          run_id):
    """Why tables.Table tracks its changelog: once a producer has sent to a topic, each metadata refresh
    asks for the topics it sent to only and the producer forgets the rest, such as the changelog whose
    partitions a table's eager partitioning reads from that cache. Apache Kafka answers just the topics
    asked for; so did Tansu in this test, though a worker on Tansu was never seen to hit it."""
    sent, other, tracked = (f"{name}-{run_id}" for name in ("sent", "other", "tracked"))

    async def partitions_known_after_a_refresh() -> dict[str, bool]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            for topic in (sent, other, tracked):  # create all three; a new producer's first refresh sees all
                await producer.send_and_wait(topic, b"x")
            await producer.stop()
            producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap)
            await producer.start()
            await track_topic(producer, tracked)
            await producer.send_and_wait(sent, b"y")
            await producer.client.force_metadata_update()
            return {topic: producer.client.cluster.partitions_for_topic(topic) is not None
                    for topic in (sent, other, tracked)}
        finally:
            await producer.stop()

    known = asyncio.run(partitions_known_after_a_refresh())
    assert known[sent] and known[tracked], known
    if broker_kind == "kafka":
        assert not known[other], "Apache Kafka answered a topic the refresh did not ask for"


def test_a_topic_with_another_partition_count_is_recreated_when_empty_and_kept_with_a_warning_when_not(
        bootstrap, run_id, caplog):
    """What a worker does with topics a restarted broker auto-created before it could create them."""
    empty, full = f"empty-{run_id}", f"full-{run_id}"
    admin = connect_admin(bootstrap)
    try:
        admin.create_topics([NewTopic(empty, 2, 1), NewTopic(full, 2, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(full, b"a step a rank's shipper sent first").get(timeout=10)
    producer.close()
    with caplog.at_level(logging.WARNING, logger="rankwatch.admin"):
        counts = ensure_topics(bootstrap, 3, (empty, full))
    assert counts == {empty: 3, full: 2}
    assert f"{KEPT_COUNT_LINE} {full} has 2 partitions, not 3" in caplog.text
    assert f"{KEPT_COUNT_LINE} {empty}" not in caplog.text

"""What differs between the two brokers the suite runs on: the Tansu workarounds are on only on Tansu."""

from __future__ import annotations

import asyncio

import pytest
from faust.types import TP
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rankwatch.admin import detect_flavor
from rankwatch.stack import READY_LINE
from rankwatch.stream_processors import tansu
from rankwatch.stream_processors.app import make_app

pytestmark = [pytest.mark.broker, pytest.mark.both_brokers]


def test_the_broker_is_told_apart_and_the_worker_runs_with_its_flavor(stack, broker_kind):
    assert detect_flavor(stack.bootstrap) == broker_kind
    ready = [line for worker in stack.workers for line in worker.tail if READY_LINE in line]
    assert ready and all(f"({broker_kind})" in line for line in ready), ready


def test_the_tansu_transport_is_chosen_only_on_tansu(stack, broker_kind):
    app = make_app(stack.settings.with_(data_dir=stack.settings.data_dir + "-probe"),
                   flavor=detect_flavor(stack.bootstrap), partitions=stack.settings.partitions)
    assert isinstance(app.transport, tansu.Transport) == (broker_kind == "tansu")
    assert all(url.scheme == ("tansu" if broker_kind == "tansu" else "kafka") for url in app.conf.broker)
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

"""Stage 2's alerts go out through a producer of their own, in the order they were decided (issue 16)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
from kafka import KafkaConsumer, TopicPartition

from rankwatch.admin import connect_admin, ensure_topics
from rankwatch.broker import free_port
from rankwatch.stream_processors.alert_sender import AlertSender, AlertSenderClosed, Paging


def _read(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    got: list[bytes] = []
    for _ in range(100):
        for records in consumer.poll(timeout_ms=200).values():
            got += [r.value for r in records]
        if len(got) >= count:
            break
    consumer.close()
    return got


@pytest.mark.broker
@pytest.mark.both_brokers
def test_decisions_from_two_threads_reach_the_topic_in_the_order_they_were_made(bootstrap, run_id):
    topic = f"alerts-{run_id}"
    ensure_topics(bootstrap, 1, (topic,))
    sender = AlertSender(bootstrap)
    paging = Paging(sender, lambda *values: [(topic, b"k", v) for v in values])
    decided: list[bytes] = []
    futures: list[Future] = []

    def decide(name: str) -> None:
        for i in range(50):
            def decision(i=i) -> list[bytes]:
                value = f"{name}{i}".encode()
                decided.append(value)  # under the lock: the order decisions were made in
                return [value, value + b"+"]  # one decision, two messages: together, in order
            futures.append(paging.decide(decision))

    threads = [threading.Thread(target=decide, args=(name,)) for name in ("a", "b")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in futures:
            f.result(timeout=30)
        assert _read(bootstrap, topic, 200) == [v for value in decided for v in (value, value + b"+")]
        assert paging.decide(lambda: []) is None  # nothing due, nothing handed over
    finally:
        sender.close()
        admin = connect_admin(bootstrap)
        admin.delete_topics([topic])
        admin.close()


def test_a_decision_that_raises_sends_nothing():
    sender = AlertSender(f"127.0.0.1:{free_port()}")  # no broker: nothing may be submitted at all
    paging = Paging(sender, lambda *values: [("t", b"k", v) for v in values])

    def decision() -> list[bytes]:
        raise ValueError("a bug")

    try:
        with pytest.raises(ValueError):
            paging.decide(decision)
        assert paging.lock.acquire(timeout=1)  # let go
        paging.lock.release()
    finally:
        sender.close(timeout_s=1)


def test_alerts_wait_while_no_broker_answers_and_fail_only_when_the_sender_closes():
    sender = AlertSender(f"127.0.0.1:{free_port()}")
    waiting = sender.submit([("t", b"k", b"v")])
    with pytest.raises(TimeoutError):
        waiting.result(timeout=2)  # retried, not dropped
    sender.close(timeout_s=1)
    with pytest.raises(AlertSenderClosed):
        waiting.result(timeout=10)
    with pytest.raises(AlertSenderClosed):
        sender.submit([("t", b"k", b"later")]).result(timeout=1)

"""The telemetry flows' alerts, sent by a producer of their own in the order they were decided (issue 16).

A NaN's page was made on the event loop and sent through Faust's producer, behind whatever else was
queued there (rollups, run events, changelogs: aiokafka keeps one request per broker in flight).
At 1,024 ranks on two cores that hop took up to 0.2 s and the loop up to 0.4 s more. Now the NaN
lane decides its pages on the reader's thread (``lane.py``), and every alert of the telemetry flows,
from the loop or from that thread, goes through one ``AlertSender``: a kafka-python producer and a
thread that sends each list handed to it, in the order handed over, and retries until the broker has
it. Alerts are decided and handed over under one lock (``Paging``), so the topic gets them in the
order they were decided. At least once, as before: never lost, repeated only after a failed send.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kafka import KafkaProducer

log = logging.getLogger(__name__)

Messages = list[tuple[str, bytes, bytes]]  # (topic, key, value), as ``topics.encoded`` makes them

RETRY_S = 1.0  # between whole re-sends, once the producer's own retries have given up (the broker away)


class AlertSender:
    """Sends lists of messages in the order ``submit`` got them; each ``Future`` is done once the
    broker has taken its list (or failed with ``AlertSenderClosed`` if the sender closed first)."""

    def __init__(self, bootstrap: str, client: dict[str, Any] | None = None):
        self.config = {
            "bootstrap_servers": bootstrap,
            "client_id": "rankwatch-alerts",
            "acks": "all",
            "linger_ms": 0,  # an alert is due when it is decided
            # One request in flight: a retry cannot put an older alert behind a newer one.
            "max_in_flight_requests_per_connection": 1,
            "metrics_enabled": False,
            "request_timeout_ms": 10_000,
            "delivery_timeout_ms": 30_000,
            # Connecting and metadata block this thread only, but no longer than a stop may wait.
            "bootstrap_timeout_ms": 5_000,
            "max_block_ms": 5_000,
            "reconnect_backoff_max_ms": 1000,  # back soon after a broker outage
            **(client or {}),  # security
        }
        self._queue: queue.SimpleQueue[tuple[Messages, Future] | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankwatch-alerts", daemon=True)
        self._thread.start()

    def submit(self, messages: Messages) -> Future:
        future: Future = Future()
        if not messages:
            future.set_result(None)
        elif self._closing.is_set():
            future.set_exception(AlertSenderClosed("the alert sender is closed"))
        else:
            self._queue.put((messages, future))
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what was handed over (for up to ``timeout_s``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._closing.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        producer = None
        try:
            while (item := self._queue.get()) is not None:
                messages, future = item
                producer = self._deliver(producer, messages)
                if producer is None:  # closed before the broker took them
                    future.set_exception(AlertSenderClosed("the alert sender closed before the broker took them"))
                else:
                    future.set_result(None)
        finally:
            self._closing.set()
            while True:  # whatever was handed over after the end: its callers must not wait for good
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].set_exception(AlertSenderClosed("the alert sender is closed"))
            if producer is not None:
                producer.close(timeout=2)

    def _deliver(self, producer: KafkaProducer | None, messages: Messages) -> KafkaProducer | None:
        failed = False
        while not self._closing.is_set():
            try:
                producer = producer or KafkaProducer(**self.config)
                sends = [producer.send(topic, key=key, value=value) for topic, key, value in messages]
                for send in sends:
                    done = threading.Event()
                    send.add_both(lambda *_, done=done: done.set())
                    while not done.wait(0.1):  # the producer's own retries, up to delivery_timeout_ms
                        if self._closing.is_set():
                            return None
                    send.get()  # raises its failure
                if failed:
                    log.warning("alerts are sent again")
                return producer
            except Exception as exc:  # noqa: BLE001 (the broker away: the alerts wait, and are sent again)
                if not failed:
                    log.warning("sending alerts failed (%s: %s); retrying every %.0f s", type(exc).__name__, exc, RETRY_S)
                failed = True
                self._closing.wait(RETRY_S)
        return None


class AlertSenderClosed(RuntimeError):
    """The worker stopped before the broker took these alerts: the input that made them is not acked."""


class Paging:
    """Alert groups decided from the event loop or from the lane's thread, one decision at a time,
    each decision's alerts handed to the sender before the lock is let go. Whoever reads or changes a
    run's groups (``RunGroups``) holds ``lock``: both threads do."""

    def __init__(self, sender: AlertSender, encode: Callable[..., Messages]):
        self.sender, self._encode = sender, encode
        # Reentrant: the loop reads a run's groups (``run_groups``) inside its decisions too.
        self.lock = threading.RLock()

    def decide(self, decision: Callable[..., list], *args: Any) -> Future | None:
        """Run ``decision(*args)`` (which changes run groups and returns the alerts due) under the lock
        and hand its alerts to the sender: None if there are none. An exception from it or from
        encoding is raised here, with nothing sent."""
        with self.lock:
            alerts = decision(*args)
            return self.sender.submit(self._encode(*alerts)) if alerts else None

"""ControlListener: the processors' advice on ``rankwatch.control``, as seen by a training rank.

A daemon thread reads every partition of the control topic with a plain kafka-python consumer
(manually assigned, from the end, no consumer group: each rank hears every message, and there is
no group join to wait for). It keeps the run's latest advice in memory; the training thread only
reads that state under a lock, so asking costs microseconds and a broker that is down or slow
never blocks or crashes training: the thread connects lazily, backs off between attempts, and logs
what goes wrong.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from rankwatch.contract import CONTROL, Control, SchemaError
from rankwatch.settings import DEFAULT_BOOTSTRAP

log = logging.getLogger(__name__)

_MAX_STOPS = 1024  # stop advice remembered per listener; old evaluations are long finished


class ControlListener:
    """Latest ``rankwatch.control`` advice for one run.

    >>> listener = ControlListener(run="exp1", bootstrap="127.0.0.1:1", connect_timeout_s=0.1)
    >>> listener.eval_interval() is None and not listener.should_stop("step-100")  # at once, no broker
    True
    >>> listener.close()
    """

    def __init__(
        self,
        *,
        run: str,
        bootstrap: str = DEFAULT_BOOTSTRAP,
        fetch_wait_ms: int = 50,
        connect_timeout_s: float = 5.0,
        max_backoff_s: float = 30.0,
        consumer_config: Mapping[str, Any] | None = None,
    ):
        if not run:
            raise ValueError("need a run name")
        self.run = run
        self.bootstrap = bootstrap
        self.fetch_wait_ms = fetch_wait_ms
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.consumer_config = dict(consumer_config or {})
        self.received = 0  # advice messages for this run, kept
        self.errors = 0  # connection or fetch failures so far
        self._lock = threading.Lock()
        self._interval: Control | None = None
        self._stops: OrderedDict[str, Control] = OrderedDict()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-control-{run}", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------------------

    def eval_interval(self) -> float | None:
        """The latest suggested evaluation interval in steps, or None when none has arrived."""
        with self._lock:
            return None if self._interval is None else self._interval.value

    def should_stop(self, eval_id: str) -> bool:
        """Whether the processors advised stopping evaluation ``eval_id`` early."""
        with self._lock:
            return eval_id in self._stops

    def latest(self, action: str, eval_id: str | None = None) -> Control | None:
        """The latest advice of ``action`` (for ``stop_eval``, the one for ``eval_id``)."""
        with self._lock:
            return self._interval if action == "set_eval_interval" else self._stops.get(eval_id or "")

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the listener is positioned at the end of every partition (tests, scripts)."""
        return self._ready.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def __enter__(self) -> ControlListener:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listener thread -------------------------------------------------------------------------

    def _run(self) -> None:
        first_backoff = min(0.5, self.max_backoff_s)
        backoff = first_backoff
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self._connect()
                if consumer is not None:
                    backoff = first_backoff
                    self._ready.set()
                    self._consume(consumer)
            except Exception as exc:  # whatever the client raises, training must not notice
                self.errors += 1
                if self.errors & (self.errors - 1) == 0:  # log at 1, 2, 4, 8… failures
                    log.warning("rankwatch: control listener for %s at %s: %s (retrying)", self.run, self.bootstrap, exc)
            finally:
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:
                        pass
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _connect(self):
        from kafka import KafkaConsumer, TopicPartition

        config = {
            "bootstrap_servers": self.bootstrap,
            "client_id": f"rankwatch-control-{self.run}",
            "group_id": None,
            "enable_auto_commit": False,
            "fetch_max_wait_ms": self.fetch_wait_ms,
            "bootstrap_timeout_ms": int(self.connect_timeout_s * 1000),
            "request_timeout_ms": max(10_000, self.fetch_wait_ms + 5000),
            **self.consumer_config,
        }
        # kafka-python 3.0 starts the consumer's IO thread before bootstrapping and leaks it when
        # bootstrapping fails; holding the object lets us stop it, or every retry would leak one.
        consumer = KafkaConsumer.__new__(KafkaConsumer)
        try:
            consumer.__init__(**config)
        except Exception:
            client = getattr(consumer, "_client", None)
            if client is not None:
                client.close()
            raise
        partitions = consumer.partitions_for_topic(CONTROL)
        if not partitions:  # not created yet: try again after the backoff
            consumer.close()
            return None
        tps = [TopicPartition(CONTROL, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        for tp in tps:
            consumer.position(tp)  # resolve the end offsets now, so wait_ready() means positioned
        return consumer

    def _consume(self, consumer) -> None:
        while not self._stop.is_set():
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    self._apply(record.value)

    def _apply(self, value: bytes) -> None:
        try:
            advice = Control.from_bytes(value)
        except SchemaError as exc:
            log.debug("rankwatch: ignoring a malformed control message: %s", exc)
            return
        if advice.run != self.run:
            return
        with self._lock:
            self.received += 1
            if advice.action == "set_eval_interval":
                if advice.value is not None and (self._interval is None or advice.ts >= self._interval.ts):
                    self._interval = advice
            elif advice.eval_id is not None:
                self._stops[advice.eval_id] = advice
                self._stops.move_to_end(advice.eval_id)
                while len(self._stops) > _MAX_STOPS:
                    self._stops.popitem(last=False)

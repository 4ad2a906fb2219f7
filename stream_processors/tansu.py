"""Workarounds for the embedded Tansu broker, in one place, active only when the broker is Tansu.

Each one answers a measured quirk (see shared/notes/tansu-broker.md); real Kafka needs none of them.
The app selects this transport with the ``tansu://`` broker scheme, registered as a Faust transport
entry point, so nothing here is imported against Apache Kafka.

Written for faust-streaming 0.15.x and aiokafka 0.14.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiokafka
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from rankwatch.stream_processors import consumer

log = logging.getLogger(__name__)

#: Quirk 2: JoinGroup is held for half the session timeout; Faust's 60 s default means a 30 s join.
APP_SETTINGS: Mapping[str, Any] = {
    "broker_session_timeout": 6.0,
    "broker_rebalance_timeout": 6.0,
    "broker_heartbeat_interval": 1.0,
}

#: Quirk 3: Tansu does not wake a long-poll fetch when data arrives, so latency is about half the
#: fetch wait; Faust hard-codes 1500 ms. 20 ms costs ~4% of a core idle and gives p99 ~70 ms.
FETCH_MAX_WAIT_MS = 20


async def true_end_offsets(bootstrap: str | list[str], reported: Mapping[TP, int], timeout_s: float = 5.0) -> dict[TP, int]:
    """Quirk 4: Tansu's ListOffsets(LATEST) answers (base offset of the last batch + 1), not the end.

    The high watermark in a Fetch response is right, so fetch from just before the reported offset
    (inside the last batch) and read it. Faust uses end offsets to know when a table's changelog
    recovery is complete; with the wrong ones it stops early and loses the latest state.

    Where a Fetch answered, its high watermark wins even when it is *lower*: a restarted broker was
    seen answering ListOffsets 1 for a partition a Fetch shows empty, and recovery then waited
    forever for an offset that never comes.
    """
    nonempty = {tp: off for tp, off in reported.items() if off > 0}
    if not nonempty:
        return dict(reported)
    probe = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=FETCH_MAX_WAIT_MS
    )
    await probe.start()
    try:
        tps = [aiokafka.TopicPartition(tp.topic, tp.partition) for tp in nonempty]
        probe.assign(tps)
        for tp in tps:
            probe.seek(tp, nonempty[TP(tp.topic, tp.partition)] - 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(probe.highwater(tp) is None for tp in tps) and loop.time() < deadline:
            await probe.getmany(*tps, timeout_ms=100)
        fixed = {TP(tp.topic, tp.partition): probe.highwater(tp) for tp in tps}
        unknown = [tp for tp, high in fixed.items() if high is None]
        if unknown:
            log.warning("no high watermark for %s within %.0fs; using ListOffsets' (possibly low) answer", unknown, timeout_s)
    finally:
        await probe.stop()
    return {tp: off if fixed.get(tp) is None else fixed[tp] for tp, off in reported.items()}


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # read by the fetcher that start() creates
        return consumer

    async def _highwaters(self, partitions):
        reported = await super()._highwaters(partitions)
        if self.consumer.in_transaction:
            return reported
        bootstrap = faust_aiokafka.server_list(self.transport.url, self.transport.default_port)
        return await true_end_offsets(bootstrap, reported)


class Consumer(consumer.Consumer):
    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with the Tansu workarounds; selected by ``tansu://host:port``."""

    Consumer = Consumer

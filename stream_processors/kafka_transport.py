"""Faust's Kafka transport for Apache Kafka, with an idempotent producer (and rankwatch's consumer,
which fetches again what Faust fetched and dropped: ``consumer``).

A partition leader killed after it wrote a batch but before it answered makes aiokafka send the
batch again, and without idempotence the retry is a second copy of every output in it: rollups
and alerts sent twice (seen in the 3-broker leader-kill test of issue 19). With idempotence the
broker drops such a copy by producer id and sequence number.

Selected with the ``rankwatch-kafka://`` broker scheme (a Faust transport entry point, like
``tansu://``). Tansu keeps Faust's plain producer: it is one process that loses everything when it
stops, so a retried batch there means the broker was never reached.

Written for faust-streaming 0.15.x and aiokafka 0.14.x (pinned in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

from rankwatch.stream_processors import consumer


class Producer(faust_aiokafka.Producer):
    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport whose producer is idempotent; selected by ``rankwatch-kafka://host:port``."""

    Consumer = consumer.Consumer
    Producer = Producer

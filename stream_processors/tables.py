"""The app's Table class: Faust's, plus one fix so that table writes work on Apache Kafka.

A table created with ``use_partitioner=True`` sends each changelog record with eager partitioning:
Faust asks the aiokafka producer for the key's partition *synchronously* (``Producer.key_partition``
-> ``AIOKafkaProducer._partition``), from the producer's cached metadata, without asking the broker.
That cache holds a topic only while the topic is in the producer client's tracked set: the first
metadata request (empty set) asks for every topic, but once the worker has sent to any topic, each
refresh asks for the tracked topics only and replaces the cache with the answer. Apache Kafka then
answers for exactly those topics, so the changelog vanishes from the cache and the write fails with
``TypeError: 'NoneType' object is not iterable`` (seen in the eval tests on Apache Kafka only; a worker
on Tansu never hit it, though Tansu too was seen answering only the topics asked for).
Fetching the changelog's metadata once is not enough: aiokafka's ``_wait_on_metadata`` returns early
for a topic that is merely cached, without tracking it, and the next refresh drops it again.

So each table, once its changelog exists, adds the changelog to the producer client's tracked topics
(every later refresh keeps it) and waits until its partitions are known. Tables start after the
producer and before recovery, hence before any write.

Written for faust-streaming 0.15.x and aiokafka 0.14.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import aiokafka
import faust


async def track_topic(producer: aiokafka.AIOKafkaProducer, topic: str) -> None:
    """Make ``topic`` part of every metadata refresh of ``producer``, and wait until it is known."""
    await producer.client.add_topic(topic)  # tracked from now on: no later refresh drops it
    await producer.partitions_for(topic)  # asks the broker until the topic's partitions are known


class Table(faust.Table):
    async def on_start(self) -> None:
        await super().on_start()  # declares (creates) the changelog topic
        producer = self.app.producer._ensure_producer()  # the aiokafka producer Faust's key_partition asks
        await track_topic(producer, self.changelog_topic.get_topic_name())

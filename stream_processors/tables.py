"""The app's Table class: Faust's, with four changes that keep a worker's state writes working.

1. **Apache Kafka's metadata.** A table created with ``use_partitioner=True`` sends each changelog
   record with eager partitioning: Faust asks the aiokafka producer for the key's partition
   *synchronously* (``Producer.key_partition`` -> ``AIOKafkaProducer._partition``), from the
   producer's cached metadata. That cache holds a topic only while the topic is in the producer
   client's tracked set: once the worker has sent to any topic, each refresh asks for the tracked
   topics only and replaces the cache with the answer. Apache Kafka then answers for exactly those
   topics, so the changelog vanishes from the cache and the write fails with ``TypeError:
   'NoneType' object is not iterable`` (seen in the eval tests on Apache Kafka only). Fetching the
   changelog's metadata once is not enough: aiokafka's ``_wait_on_metadata`` returns early for a
   topic that is merely cached, without tracking it. So each table, once its changelog exists, adds
   the changelog to the tracked topics and waits until its partitions are known. Tables start after
   the producer and before recovery, hence before any write.

2. **Compact state.** Values are msgpack (``STATE_CODEC``), not JSON: about half the bytes and a
   fraction of the encoding time for state that is mostly per-rank numbers. Records written as JSON
   by an older worker are still read.

3. **No record too large to send.** The producer refuses a record over its request size (1 MiB),
   and Faust's producer buffer then stops the whole worker (issue 16's bench at 128 ranks: one run's
   cross-rank state reached 1.03 MB; a rank logging a thousand per-layer metrics gets there too).
   Each value is encoded here, before Faust sees it, and one over ``MAX_RECORD_BYTES`` is written as
   pieces under part keys (``key + PART_SEP + b"#i"``) followed by a small record under the key that
   names them; reading the key joins them. A part record goes to the changelog partition of the key
   before ``PART_SEP``, so the worker that recovers a key recovers its pieces. Pieces and their
   index carry one nonce: a worker killed between writing the pieces and the index leaves the older
   index, whose pieces no longer match, and that state starts over (logged) instead of being misread.
   Pieces a later value or a delete no longer needs get tombstones, so an expired state leaves none.
   ``keys()`` lists part keys too (``is_part``).

4. **Recovery never takes a worker's own state back in time.** On a rebalance Faust revokes every
   partition and reads the changelog of each one it gets back into the memory store, over what is
   there. A write still in flight (a partition leader failing over delays it by seconds) is then
   replaced by the older value before it, while the consumer resumes at its last commit: messages
   after that value were applied twice (seen on a 3-broker cluster as every window of a rank rolled
   up twice). A key this worker wrote while holding its partition, and still holds, is newer than
   anything in the changelog, so recovery skips it. Partitions the worker loses are forgotten, so a
   key that comes back after another worker wrote it is read from the changelog again. It relies on
   Faust's assignor giving a worker the same partitions of co-partitioned topics.

Written for faust-streaming 0.15.x and aiokafka 0.14.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict

import aiokafka
import faust
import msgpack
import numpy as np
from faust.serializers import codecs

log = logging.getLogger(__name__)

STATE_CODEC = "rankwatch-state"
# aiokafka's default max_request_size is 1 MiB (1,048,576 bytes) for the record's whole batch, and
# Kafka's default message.max.bytes is about the same: leave room for the key and the batch header.
MAX_RECORD_BYTES = 1_000_000
PIECE_BYTES = 900_000  # of an encoded value, per part record (leaves room for its wrapper)
PART_SEP = b"\x00"  # in no run id or telemetry key: the contract refuses NUL in any string
_PIECES = "__pieces__"


def is_part(key) -> bool:
    """Whether a table key holds a piece of another key's value, not a value of its own."""
    return isinstance(key, bytes) and PART_SEP in key


def _piece_key(key: bytes, i: int) -> bytes:
    return key + PART_SEP + b"#%d" % i


def _plain(obj):
    if hasattr(obj, "__json__"):
        return obj.__json__()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__} in a table's state")


class StateCodec(codecs.Codec):
    """msgpack of the value's ``__json__()``; reads JSON too (``{`` starts no msgpack map)."""

    def _dumps(self, obj) -> bytes:
        return msgpack.packb(obj, default=_plain)  # msgpack asks ``_plain`` for what it cannot pack

    def _loads(self, s: bytes):
        if s[:1] == b"{":
            return json.loads(s)
        return msgpack.unpackb(s, raw=False, strict_map_key=False)


codecs.register(STATE_CODEC, StateCodec())


async def track_topic(producer: aiokafka.AIOKafkaProducer, topic: str) -> None:
    """Make ``topic`` part of every metadata refresh of ``producer``, and wait until it is known."""
    await producer.client.add_topic(topic)  # tracked from now on: no later refresh drops it
    await producer.partitions_for(topic)  # asks the broker until the topic's partitions are known


class Table(faust.Table):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Before the store and the changelog topic, which are made on first use, take it from here.
        self.value_serializer = STATE_CODEC
        self._held: defaultdict[int, set] = defaultdict(set)  # partition -> keys written while holding it
        self._pieces: dict[bytes, int] = {}  # key -> how many pieces its last known value was written in

    async def on_start(self) -> None:
        await super().on_start()  # declares (creates) the changelog topic
        producer = self.app.producer._ensure_producer()  # the aiokafka producer Faust's key_partition asks
        await track_topic(producer, self.changelog_topic.get_topic_name())

    def send_changelog(self, partition, key, value, key_serializer=None, value_serializer=None):
        if partition is None and is_part(key):  # with the key it is a part of
            partition = self.partition_of(key.partition(PART_SEP)[0])
        before = self._pieces.pop(key, 0) if isinstance(key, bytes) else 0
        if value is None and not before:  # a delete of a value recovered in pieces, never read
            stored = self.data.get(key)
            before = stored[_PIECES] if isinstance(stored, dict) and _PIECES in stored else 0
        if value is not None:
            value = self.app.serializers.dumps_value(
                self.value_type, value, serializer=value_serializer or self.value_serializer)
            if len(value) > MAX_RECORD_BYTES and isinstance(key, bytes):
                if partition is None:  # the partition eager partitioning would give the key
                    partition = self.partition_of(key)
                value = self._send_pieces(partition, key, value)
        for i in range(self._pieces.get(key, 0), before):  # pieces the new value (or a delete) leaves over
            self.data.pop(_piece_key(key, i), None)
            self.send_changelog(None, _piece_key(key, i), None)
        sent = super().send_changelog(partition, key, value, key_serializer, "raw")
        self._held[sent.message.partition].add(key)  # eager partitioning has set it
        return sent

    async def on_rebalance(self, assigned, revoked, newly_assigned, generation_id=0) -> None:
        # Active partitions only: a changelog partition assigned alone is a standby, kept up to date
        # by another worker's writes.
        kept = {tp.partition for tp in assigned if not tp.topic.endswith("-changelog")}
        for partition in [p for p in self._held if p not in kept]:
            del self._held[partition]  # another worker may write its keys now
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)

    def apply_changelog_batch(self, batch) -> None:
        held = set().union(*self._held.values())
        if held:
            batch = [e for e in batch if (e.key.partition(PART_SEP)[0] if is_part(e.key) else e.key) not in held]
        super().apply_changelog_batch(batch)

    def partition_of(self, key: bytes) -> int:
        """The changelog partition of ``key``: the partition of its stream, which the table shares."""
        return self.app.producer.key_partition(self.changelog_topic.get_topic_name(), key).partition

    def _send_pieces(self, partition: int, key: bytes, data: bytes) -> bytes:
        """Send ``data`` as part records on ``partition``; return the index record to write under ``key``."""
        nonce = os.urandom(8)
        count = -(-len(data) // PIECE_BYTES)
        for i in range(count):
            piece = msgpack.packb({"of": nonce, "data": data[i * PIECE_BYTES : (i + 1) * PIECE_BYTES]})
            super().send_changelog(partition, _piece_key(key, i), piece, None, "raw")
        self._pieces[key] = count
        return msgpack.packb({_PIECES: count, "of": nonce})

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, dict) and _PIECES in value:  # recovered from the changelog in pieces
            self._pieces[key] = value[_PIECES]
            value = self.data[key] = self._join(key, value)
        return value

    def _join(self, key: bytes, index: dict):
        pieces = [self.data.get(_piece_key(key, i)) for i in range(index[_PIECES])]
        if not all(isinstance(p, dict) and p.get("of") == index["of"] for p in pieces):
            log.error("table %s: the stored value of %r is missing pieces (a worker stopped while writing "
                      "it); it starts over", self.name, key)
            return None
        return self.app.serializers.loads_value(
            self.value_type, b"".join(p["data"] for p in pieces), serializer=self.value_serializer)

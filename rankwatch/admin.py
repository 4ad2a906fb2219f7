"""Small broker-side chores with kafka-python: wait for a broker, create topics, tell Tansu from Kafka."""

from __future__ import annotations

import logging
import time

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError

from rankwatch.contract import INTERNAL_TOPICS, TOPICS
from rankwatch.errors import BrokerError
from rankwatch.security import PLAINTEXT, KafkaSecurity, check_login

log = logging.getLogger(__name__)

KEPT_COUNT_LINE = "topic kept with another partition count:"  # tests look for it
#: How long a create or a delete may take to show. Apache Kafka answers both before every broker's
#: metadata has them (a create right after a delete is refused: the name is not free yet); Tansu at once.
SETTLE_S = 30.0


def connect_admin(bootstrap: str, timeout_s: float = 10.0, *, security: KafkaSecurity = PLAINTEXT) -> KafkaAdminClient:
    """An admin client, retrying until the broker answers a metadata request or ``timeout_s`` passes."""
    check_login(bootstrap, security)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, client_id="rankwatch-admin",
                                    **security.kafka_python())
        except KafkaError as exc:  # NoBrokersAvailable while the broker starts
            last = exc
            time.sleep(0.1)
    raise BrokerError(f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f}s ({last})") from last


def wait_for_broker(bootstrap: str, timeout_s: float = 10.0, *, security: KafkaSecurity = PLAINTEXT) -> None:
    connect_admin(bootstrap, timeout_s, security=security).close()


def ensure_topics(bootstrap: str, partitions: int, topics: tuple[str, ...] = TOPICS + INTERNAL_TOPICS, *,
                  replication: int = 1, security: KafkaSecurity = PLAINTEXT) -> dict[str, int]:
    """Create the missing rankwatch topics (``replication`` replicas each); return every topic's actual partition count.

    A broker that auto-creates topics (Tansu does, with 4 partitions) may get there first, above all
    right after a restart, when clients reconnect. Such a topic that is still empty is deleted and
    created again with ``partitions``; one that holds messages keeps its count (deleting would lose
    them) and workers adopt what they find.
    """
    admin = connect_admin(bootstrap, security=security)
    try:
        counts = _partition_counts(admin, topics)
        wrong = [t for t in topics if t in counts and counts[t] != partitions]
        empty = _empty(bootstrap, {t: counts[t] for t in wrong}, security)
        if empty:
            log.warning("re-creating %s with %d partitions (found empty, with another count)", empty, partitions)
            _delete(admin, empty)
        for topic in (t for t in wrong if t not in empty):
            log.warning(KEPT_COUNT_LINE + " %s has %d partitions, not %d, and holds messages: kept as it is, since "
                        "deleting it would lose them (at most %d workers share it)", topic, counts[topic], partitions,
                        counts[topic])
        made = [t for t in topics if t not in counts or t in empty]
        return {**counts, **_create_until_shown(admin, made, partitions, replication)}
    finally:
        admin.close()


def drop_mismatched(bootstrap: str, topics: list[str], partitions: int, *,
                    security: KafkaSecurity = PLAINTEXT) -> list[str]:
    """Delete those of ``topics`` that exist with another partition count than ``partitions``.

    For Faust's changelog topics, which Faust creates (with its own configs) when they are missing:
    a changelog whose count differs from its table's can never be read back (a restarted broker
    auto-created it from a worker's late writes), and what it holds is a state the broker lost.
    """
    admin = connect_admin(bootstrap, security=security)
    try:
        counts = _partition_counts(admin, tuple(topics))
        wrong = [t for t in topics if t in counts and counts[t] != partitions]
        if wrong:
            log.warning("deleting %s: partition counts %s, not %d", wrong, [counts[t] for t in wrong], partitions)
            _delete(admin, wrong)
            _await_gone(admin, wrong)  # Faust creates them again
        return wrong
    finally:
        admin.close()


def _partition_counts(admin: KafkaAdminClient, topics: tuple[str, ...]) -> dict[str, int]:
    existing = set(admin.list_topics())
    present = [t for t in topics if t in existing]
    return {d["name"]: len(d["partitions"]) for d in admin.describe_topics(present)} if present else {}


def _create_until_shown(admin: KafkaAdminClient, topics: list[str], partitions: int,
                        replication: int) -> dict[str, int]:
    """Create ``topics``; their counts once each shows with ``partitions``, creating again those still
    missing (refused while a deleted one's name is not free); after ``SETTLE_S``, what shows then (a
    worker adopts it). Raises ``BrokerError`` if one is still missing: no worker can read it."""
    deadline = time.monotonic() + SETTLE_S
    missing = list(topics)
    while True:
        _create(admin, missing, partitions, replication)
        counts = _partition_counts(admin, tuple(topics)) if topics else {}
        missing = [t for t in topics if t not in counts]
        if not missing and set(counts.values()) <= {partitions}:
            return counts
        if time.monotonic() > deadline:
            if missing:
                raise BrokerError(f"topics {missing} were not there {SETTLE_S:.0f}s after they were created")
            return counts
        time.sleep(0.2)


def _await_gone(admin: KafkaAdminClient, topics: list[str]) -> None:
    """Until none of the deleted ``topics`` shows (or ``SETTLE_S``): whoever creates them next is refused
    while a name is not free."""
    deadline = time.monotonic() + SETTLE_S
    while _partition_counts(admin, tuple(topics)) and time.monotonic() < deadline:
        time.sleep(0.2)


def _empty(bootstrap: str, counts: dict[str, int], security: KafkaSecurity = PLAINTEXT) -> list[str]:
    if not counts:
        return []
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, request_timeout_ms=5000,
                             **security.kafka_python())
    try:
        ends = consumer.end_offsets([TopicPartition(t, p) for t, n in counts.items() for p in range(n)])
    finally:
        consumer.close()
    return [t for t in counts if not any(end for tp, end in ends.items() if tp.topic == t)]


def _delete(admin: KafkaAdminClient, topics: list[str]) -> None:
    try:
        admin.delete_topics(topics)
    except UnknownTopicOrPartitionError:
        pass  # someone else deleted it first


def _create(admin: KafkaAdminClient, topics: list[str], partitions: int, replication: int = 1) -> None:
    if not topics:
        return
    try:
        admin.create_topics([NewTopic(t, partitions, replication) for t in topics])
    except TopicAlreadyExistsError:
        pass  # another process (or an auto-create) won the race; the counts read after are what matters


def detect_flavor(bootstrap: str, *, security: KafkaSecurity = PLAINTEXT) -> str:
    """``"tansu"`` when the cluster id says so (Tansu's default is ``tansu_cluster``), else ``"kafka"``."""
    admin = connect_admin(bootstrap, security=security)
    try:
        cluster_id = admin.describe_cluster().get("cluster_id") or ""
    except KafkaError:
        cluster_id = ""
    finally:
        admin.close()
    return "tansu" if cluster_id.lower().startswith("tansu") else "kafka"

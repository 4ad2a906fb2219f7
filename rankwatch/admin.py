"""Small broker-side chores with kafka-python: wait for a broker, create topics, tell Tansu from Kafka."""

from __future__ import annotations

import logging
import time

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from rankwatch.contract import INTERNAL_TOPICS, TOPICS
from rankwatch.errors import BrokerError

log = logging.getLogger(__name__)


def connect_admin(bootstrap: str, timeout_s: float = 10.0) -> KafkaAdminClient:
    """An admin client, retrying until the broker answers a metadata request or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, client_id="rankwatch-admin")
        except KafkaError as exc:  # NoBrokersAvailable while the broker starts
            last = exc
            time.sleep(0.1)
    raise BrokerError(f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f}s ({last})")


def wait_for_broker(bootstrap: str, timeout_s: float = 10.0) -> None:
    connect_admin(bootstrap, timeout_s).close()


def ensure_topics(bootstrap: str, partitions: int, topics: tuple[str, ...] = TOPICS + INTERNAL_TOPICS) -> dict[str, int]:
    """Create the missing rankwatch topics; return every topic's actual partition count.

    Existing topics keep their partition count (Tansu auto-creates topics with 4 partitions when a
    producer gets there first); workers adopt what they find.
    """
    admin = connect_admin(bootstrap)
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(t, partitions, 1) for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # another process won the race; the counts below are what matters
        described = admin.describe_topics(list(topics))
        return {d["name"]: len(d["partitions"]) for d in described}
    finally:
        admin.close()


def detect_flavor(bootstrap: str) -> str:
    """``"tansu"`` when the cluster id says so (Tansu's default is ``tansu_cluster``), else ``"kafka"``."""
    admin = connect_admin(bootstrap)
    try:
        cluster_id = admin.describe_cluster().get("cluster_id") or ""
    except KafkaError:
        cluster_id = ""
    finally:
        admin.close()
    return "tansu" if cluster_id.lower().startswith("tansu") else "kafka"

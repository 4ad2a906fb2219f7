"""Read a rankwatch topic with a plain kafka-python consumer (manual assignment, no group).

End offsets come from the high watermark that Fetch responses carry, not from ListOffsets, which
the embedded broker answers wrongly (Tansu quirk 4: the base offset of the last batch + 1, so a
reader "starting at the end" replayed the tail of the last batch). Both "caught up" and "start at
the end" use it; it is right on every broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from rankwatch.security import PLAINTEXT, KafkaSecurity, check_login

log = logging.getLogger(__name__)

# How long a reader waits for a first broker when it does not follow (as `up`, 10 s). One that
# follows may be started beside its broker (Apache Kafka takes seconds to start) and keeps
# kafka-python's 30 s.
BOOTSTRAP_TIMEOUT_S = 10.0
FOLLOW_BOOTSTRAP_TIMEOUT_S = 30.0


def read_topic(
    bootstrap: str,
    topic: str,
    *,
    follow: bool = False,
    from_beginning: bool = True,
    poll_ms: int = 100,
    stop_after_s: float | None = None,
    offsets: Mapping[int, int] | None = None,
    stop: Callable[[], bool] | None = None,
    on_poll: Callable[[], None] | None = None,
    security: KafkaSecurity = PLAINTEXT,
) -> Iterator[ConsumerRecord]:
    """Yield the topic's records in per-partition order; stop when caught up unless ``follow``.

    A topic that does not exist yet has nothing to read; a reader that follows waits for it.

    ``offsets`` (partition -> next offset) resumes where an earlier reader stopped; partitions
    not in it start at the beginning or the end as ``from_beginning`` says. ``stop()`` is asked
    after every poll (``poll_ms``): a reader that follows ends cleanly when it says True.
    ``on_poll()`` is called after every poll too, also when nothing arrived (periodic work such
    as re-sending firing alerts).
    """
    check_login(bootstrap, security)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        fetch_max_wait_ms=50,  # a reader is interactive; on Tansu this also bounds the added latency
        client_id="rankwatch-reader",
        allow_auto_create_topics=False,
        bootstrap_timeout_ms=int(1000 * (FOLLOW_BOOTSTRAP_TIMEOUT_S if follow else BOOTSTRAP_TIMEOUT_S)),
        **security.kafka_python(),
    )
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s

    def more() -> bool:
        return (deadline is None or time.monotonic() < deadline) and not (stop is not None and stop())

    try:
        # A reader never creates a topic: one made here would have the wrong partition count for
        # good (only the workers create topics, with the configured count).
        while not (partitions := consumer.partitions_for_topic(topic)):
            if not (follow and more()):
                return
            time.sleep(0.5)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        given = {tp: offsets[tp.partition] for tp in tps if offsets and tp.partition in offsets}
        rest = [tp for tp in tps if tp not in given]
        if from_beginning:
            if rest:
                consumer.seek_to_beginning(*rest)
        else:
            given.update(end_offsets(consumer, rest))
        for tp, offset in given.items():
            consumer.seek(tp, offset)
        while more():
            got = consumer.poll(timeout_ms=poll_ms)
            for tp in tps:
                yield from got.get(tp, ())
            if on_poll is not None:
                on_poll()
            if not follow and not got and caught_up(consumer, tps):
                return
    finally:
        consumer.close()


def end_offsets(consumer: KafkaConsumer, tps: list[TopicPartition], timeout_s: float = 5.0) -> dict[TopicPartition, int]:
    """The true end of each partition: the high watermark of a Fetch from just before ListOffsets' answer.

    ``consumer`` must have ``tps`` assigned; their positions are moved (seek afterwards). Where no
    Fetch answers within ``timeout_s``, ListOffsets' (on Tansu possibly low) answer is used, with a warning.
    """
    reported = consumer.end_offsets(tps) if tps else {}
    probe = [tp for tp, offset in reported.items() if offset > 0]  # an empty partition's 0 is right
    for tp in probe:
        consumer.seek(tp, reported[tp] - 1)  # inside the last batch: its Fetch carries the high watermark
    end = time.monotonic() + timeout_s
    while any(consumer.highwater(tp) is None for tp in probe) and time.monotonic() < end:
        consumer.poll(timeout_ms=100)  # records dropped: only the high watermark is wanted
    fixed = dict(reported)
    for tp in probe:
        high = consumer.highwater(tp)
        if high is None:
            log.warning("no high watermark for %s within %.0fs; starting at ListOffsets' (possibly low) answer",
                        tp, timeout_s)
        else:
            fixed[tp] = high
    return fixed


def caught_up(consumer: KafkaConsumer, tps: list[TopicPartition]) -> bool:
    """Whether the consumer has read every partition to the high watermark Fetch responses carry
    (not ListOffsets, which the embedded broker answers wrongly)."""
    for tp in tps:
        high = consumer.highwater(tp)
        if high is None or consumer.position(tp) < high:
            return False
    return True

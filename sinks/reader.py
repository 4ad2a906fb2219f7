"""Read a rankwatch topic with a plain kafka-python consumer (manual assignment, no group).

"Caught up" is judged against the high watermark that Fetch responses carry, not ListOffsets,
which the embedded broker answers wrongly; that check is right on every broker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord



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
) -> Iterator[ConsumerRecord]:
    """Yield the topic's records in per-partition order; stop when caught up unless ``follow``.

    A topic that does not exist yet has nothing to read; a reader that follows waits for it.

    ``offsets`` (partition -> next offset) resumes where an earlier reader stopped; partitions
    not in it start at the beginning or the end as ``from_beginning`` says. ``stop()`` is asked
    after every poll (``poll_ms``): a reader that follows ends cleanly when it says True.
    """
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        fetch_max_wait_ms=50,  # a reader is interactive; on Tansu this also bounds the added latency
        client_id="rankwatch-reader",
        allow_auto_create_topics=False,
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
        if from_beginning:
            consumer.seek_to_beginning(*tps)
        else:
            consumer.seek_to_end(*tps)
        for tp in tps:
            if offsets and tp.partition in offsets:
                consumer.seek(tp, offsets[tp.partition])
        while more():
            got = consumer.poll(timeout_ms=poll_ms)
            for tp in tps:
                yield from got.get(tp, ())
            if not follow and not got and _caught_up(consumer, tps):
                return
    finally:
        consumer.close()


def _caught_up(consumer: KafkaConsumer, tps: list[TopicPartition]) -> bool:
    for tp in tps:
        high = consumer.highwater(tp)
        if high is None or consumer.position(tp) < high:
            return False
    return True

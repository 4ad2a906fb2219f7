"""Faust handles on the contract's topics, and the one way flows dead-letter a message."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import faust

from rankwatch import contract
from rankwatch.contract import DeadLetter, MessageTooLarge, check_size
from rankwatch.errors import SchemaError

T = TypeVar("T")

log = logging.getLogger(__name__)

SUMMARY_S = 10.0  # how often the worker logs its dead-letter counts, when they changed
KEPT_KEY_BYTES = 1024  # of a dead-lettered message's key: the letter must fit in a message too


def raw_topic(app: faust.App, name: str) -> faust.TopicT:
    """A topic of raw bytes: our code decodes, so a bad message is ours to dead-letter, not Faust's to drop."""
    return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


class DeadLetterer:
    """``await dead_letter(event, reason)``: the original bytes (truncated if large), where they came
    from and why, to ``rankwatch.deadletter``; ``counts`` by cause (the reason up to its first ": ").

    The first letter of each cause is logged as a warning, the rest at info level; every
    ``SUMMARY_S`` the worker logs the running counts, so a flood of bad input is visible at a glance.
    """

    def __init__(self, app: faust.App):
        self.topic = raw_topic(app, contract.DEADLETTER)
        self.counts: Counter[str] = Counter()
        self._summarised = 0

        @app.timer(interval=SUMMARY_S)
        async def summarise_dead_letters():
            self.summarise()

    async def __call__(self, event: faust.EventT, reason: str) -> None:
        msg = event.message
        letter = DeadLetter.of(reason, msg.topic, msg.partition, msg.offset, msg.value or b"", time.time())
        self.counts[letter.cause] += 1
        level = logging.WARNING if self.counts[letter.cause] == 1 else logging.INFO
        log.log(level, "dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, letter.reason)
        key = msg.key[:KEPT_KEY_BYTES] if msg.key else msg.key
        await self.topic.send(key=key, value=letter.to_bytes())

    def summarise(self) -> None:
        total = sum(self.counts.values())
        if total != self._summarised:
            self._summarised = total
            by_cause = ", ".join(f"{cause}: {n:,}" for cause, n in self.counts.most_common())
            log.warning("rankwatch: %s messages dead-lettered since the worker started (%s); "
                        "`rankwatch deadletters` counts them all", f"{total:,}", by_cause)


# One per app, so the telemetry and eval flows share one count.
_DEAD_LETTERERS: weakref.WeakKeyDictionary[faust.App, DeadLetterer] = weakref.WeakKeyDictionary()


def dead_letterer(app: faust.App) -> DeadLetterer:
    if app not in _DEAD_LETTERERS:
        _DEAD_LETTERERS[app] = DeadLetterer(app)
    return _DEAD_LETTERERS[app]


async def decoded(
    events: AsyncIterator[faust.EventT],
    decode: Callable[[bytes], T],
    dead_letter: DeadLetterer,
    what: str,
) -> AsyncIterator[tuple[faust.EventT, T]]:
    """``(event, decoded value)`` for each event; one that is too large or does not decode is
    dead-lettered with why. Nothing a message holds can end this loop."""
    async for event in events:
        msg = event.message
        try:
            check_size(len(msg.key or b"") + len(event.value or b""))  # before the cost of decoding
            item: Any = decode(event.value)
        except MessageTooLarge as exc:
            await dead_letter(event, f"oversized {what}: {exc}")
            continue
        except SchemaError as exc:
            await dead_letter(event, f"invalid {what}: {exc}")
            continue
        except Exception as exc:  # a decoder's bug: the contract promises SchemaError only
            log.exception("decoding %s[%d]@%d failed", msg.topic, msg.partition, msg.offset)
            await dead_letter(event, f"invalid {what}: {type(exc).__name__}: {exc}")
            continue
        yield event, item


def encoded(*events: Any) -> list[tuple[str, bytes, bytes]]:
    """``(topic, key, value)`` of each event, each within the size limit. A flow encodes all that one
    message produced before it sends any of it: an event that cannot be sent dead-letters the
    message instead of stopping the stream halfway through its output."""
    out = []
    for event in events:
        value = event.to_bytes()
        key = event.key if isinstance(event.key, bytes) else event.key.encode()
        check_size(len(key) + len(value), f"{event.KIND} event")
        out.append((event.TOPIC, key, value))
    return out


async def send_all(topics: dict[str, faust.TopicT], messages: list[tuple[str, bytes, bytes]]) -> None:
    """Send ``messages`` in order and return once the broker has taken every one.

    Flows write the state that records a message as applied only after this returns: a table write
    goes to its changelog on its own schedule, and one that landed before the output would, after
    a crash, make the replay look applied while its output was lost. This order can only repeat.
    """
    pending = [await topics[topic].send(key=key, value=value) for topic, key, value in messages]
    if pending:
        await asyncio.gather(*pending)

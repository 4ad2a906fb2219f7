"""Faust handles on the contract's topics, and the one way flows dead-letter a message."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import faust

from rankwatch import contract
from rankwatch.contract import DeadLetter
from rankwatch.errors import SchemaError

T = TypeVar("T")

log = logging.getLogger(__name__)


def raw_topic(app: faust.App, name: str) -> faust.TopicT:
    """A topic of raw bytes: our code decodes, so a bad message is ours to dead-letter, not Faust's to drop."""
    return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def dead_letterer(app: faust.App) -> Callable[[faust.EventT, str], Awaitable[None]]:
    """``await dead_letter(event, reason)``: the original bytes and where they came from, with why."""
    topic = raw_topic(app, contract.DEADLETTER)

    async def dead_letter(event: faust.EventT, reason: str) -> None:
        msg = event.message
        log.warning("dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
        letter = DeadLetter(reason, msg.topic, msg.partition, msg.offset, msg.value or b"", time.time())
        await topic.send(key=msg.key, value=letter.to_bytes())

    return dead_letter


async def decoded(
    events: AsyncIterator[faust.EventT],
    decode: Callable[[bytes], T],
    dead_letter: Callable[[faust.EventT, str], Awaitable[None]],
    what: str,
) -> AsyncIterator[tuple[faust.EventT, T]]:
    """``(event, decoded value)`` for each event; one that does not decode is dead-lettered with why."""
    async for event in events:
        try:
            item: Any = decode(event.value)
        except SchemaError as exc:
            await dead_letter(event, f"invalid {what}: {exc}")
            continue
        yield event, item

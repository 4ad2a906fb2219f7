"""Dead letters: what could not be processed, why, and the original bytes (or, for a large message,
their start with the whole message's size and SHA-256)."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    b64decode_field,
    dumps,
    field_of,
    loads,
    ts_field,
)
from rankwatch.contract.topics import DEADLETTER

#: Payload bytes a dead letter keeps: base64 of a message near the size limit would itself be over it.
KEPT_PAYLOAD_BYTES = 64 * 1024
#: Characters of the reason a dead letter keeps (an error message may quote what it rejects).
KEPT_REASON_CHARS = 2000


@dataclass(frozen=True)
class DeadLetter:
    """A message that could not be processed, with why and where it came from.

    ``reason`` reads ``"<cause>: <detail>"``; ``cause`` is what counts group by. ``payload`` is the
    original bytes, or their first ``KEPT_PAYLOAD_BYTES`` when ``truncated``: ``payload_size``
    and ``payload_sha256`` always describe the whole original (the defaults: ``payload``'s own).

    >>> letter = DeadLetter.of("invalid telemetry: bad", "rankwatch.telemetry", 0, 7, b"x" * 100_000, ts=0.0)
    >>> letter.cause, len(letter.payload), letter.payload_size, letter.truncated
    ('invalid telemetry', 65536, 100000, True)
    """

    reason: str
    topic: str
    partition: int
    offset: int
    payload: bytes
    ts: float
    payload_size: int = -1
    payload_sha256: str = ""

    KIND = "deadletter"
    TOPIC = DEADLETTER

    def __post_init__(self) -> None:
        if self.payload_size < 0:
            object.__setattr__(self, "payload_size", len(self.payload))
        if not self.payload_sha256:
            object.__setattr__(self, "payload_sha256", hashlib.sha256(self.payload).hexdigest())

    @classmethod
    def of(cls, reason: str, topic: str, partition: int, offset: int, payload: bytes, ts: float) -> DeadLetter:
        """A dead letter that always fits in a message, however large ``payload`` and ``reason`` are."""
        if len(reason) > KEPT_REASON_CHARS:
            reason = reason[:KEPT_REASON_CHARS] + f"… ({len(reason):,} characters)"
        return cls(reason, topic, partition, offset, payload[:KEPT_PAYLOAD_BYTES], ts,
                   len(payload), hashlib.sha256(payload).hexdigest())

    @property
    def cause(self) -> str:
        return self.reason.split(": ", 1)[0]

    @property
    def truncated(self) -> bool:
        return self.payload_size > len(self.payload)

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "schema": SCHEMA_VERSION,
                "kind": self.KIND,
                "reason": self.reason,
                "topic": self.topic,
                "partition": self.partition,
                "offset": self.offset,
                "payload_b64": base64.b64encode(self.payload).decode(),
                "payload_size": self.payload_size,
                "payload_sha256": self.payload_sha256,
                "truncated": self.truncated,
                "ts": self.ts,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> DeadLetter:
        obj = loads(data, cls.KIND)
        # Letters written before sizes and hashes were kept carry their whole payload.
        return cls(
            reason=field_of(obj, "reason", str),
            topic=field_of(obj, "topic", str),
            partition=field_of(obj, "partition", int),
            offset=field_of(obj, "offset", int),
            payload=b64decode_field(field_of(obj, "payload_b64", str)),
            ts=ts_field(obj),
            payload_size=field_of(obj, "payload_size", int) if "payload_size" in obj else -1,
            payload_sha256=field_of(obj, "payload_sha256", str) if "payload_sha256" in obj else "",
        )

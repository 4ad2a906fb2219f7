"""Dead letters: what could not be processed, why, and the original bytes."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    b64decode_field,
    dumps,
    field_of,
    loads,
)
from rankwatch.contract.topics import DEADLETTER


@dataclass(frozen=True)
class DeadLetter:
    """A message that could not be processed, with why and where it came from; nothing is lost."""

    reason: str
    topic: str
    partition: int
    offset: int
    payload: bytes
    ts: float

    KIND = "deadletter"
    TOPIC = DEADLETTER

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
                "ts": self.ts,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> DeadLetter:
        obj = loads(data, cls.KIND)
        return cls(
            reason=field_of(obj, "reason", str),
            topic=field_of(obj, "topic", str),
            partition=field_of(obj, "partition", int),
            offset=field_of(obj, "offset", int),
            payload=b64decode_field(field_of(obj, "payload_b64", str)),
            ts=float(field_of(obj, "ts", (int, float))),
        )

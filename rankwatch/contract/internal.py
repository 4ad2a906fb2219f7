"""Events between the processors' stages, on ``RUN_EVENTS`` (key: run). Not for outside consumers.

Stage 1 is keyed by (run, rank) and scales with ranks; stage 2 is keyed by run and sees every
rank of a run, which grouping, cross-rank comparison and stall detection need.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankwatch.contract.alerts import Alert
from rankwatch.contract.codec import SCHEMA_VERSION, dumps, field_of, loads
from rankwatch.contract.topics import RUN_EVENTS


@dataclass(frozen=True)
class RankSignal:
    """One rank's condition changed (``alert`` has that rank); stage 2 groups it with its peers."""

    alert: Alert
    world_size: int

    KIND = "rank_signal"
    TOPIC = RUN_EVENTS

    @property
    def key(self) -> bytes:
        return self.alert.run.encode()

    def to_bytes(self) -> bytes:
        return dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, "world_size": self.world_size,
                      "alert": self.alert.to_dict()})

    @classmethod
    def from_bytes(cls, data: bytes) -> RankSignal:
        obj = loads(data, cls.KIND)
        return cls(alert=Alert.from_dict(field_of(obj, "alert", dict)), world_size=field_of(obj, "world_size", int))

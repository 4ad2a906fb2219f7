"""Alert transitions."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    dumps,
    encode_float,
    field_of,
    float_field,
    loads,
)
from rankwatch.contract.topics import ALERTS
from rankwatch.errors import SchemaError

STATUSES = ("firing", "resolved")
SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Alert:
    """One alert transition. ``key`` names the condition (same key for its firing and its resolve);
    ``(key, status, incident)`` names the transition, so consumers can drop redeliveries."""

    key: str
    run: str
    status: str
    severity: str
    detector: str
    metric: str
    rank: int | None
    step: int
    value: float
    message: str
    ts: float
    score: float = 1.0
    incident: int = 0  # step at which this condition started firing

    KIND = "alert"
    TOPIC = ALERTS

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise SchemaError(f"alert status must be one of {STATUSES}, got {self.status!r}")
        if self.severity not in SEVERITIES:
            raise SchemaError(f"alert severity must be one of {SEVERITIES}, got {self.severity!r}")

    @staticmethod
    def make_key(run: str, detector: str, metric: str, rank: int | None) -> str:
        return f"{run}/{detector}/{metric}/{'all' if rank is None else rank}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["value"] = encode_float(self.value)
        return {"schema": SCHEMA_VERSION, "kind": self.KIND, **d}

    def to_bytes(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> Alert:
        obj = loads(data, cls.KIND)
        return cls(
            key=field_of(obj, "key", str),
            run=field_of(obj, "run", str),
            status=field_of(obj, "status", str),
            severity=field_of(obj, "severity", str),
            detector=field_of(obj, "detector", str),
            metric=field_of(obj, "metric", str),
            rank=field_of(obj, "rank", int, nullable=True),
            step=field_of(obj, "step", int),
            value=float_field(obj, "value"),
            message=field_of(obj, "message", str),
            ts=float(field_of(obj, "ts", (int, float))),
            score=float_field(obj, "score", 1.0),
            incident=field_of(obj, "incident", int) if "incident" in obj else 0,
        )

"""Alert transitions."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    check_event,
    dumps,
    encode_float,
    field_of,
    float_field,
    loads,
    ts_field,
)
from rankwatch.contract.topics import ALERTS
from rankwatch.errors import SchemaError

STATUSES = ("firing", "resolved")
SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Alert:
    """One alert transition. ``key`` names the condition (same key for its firing and its resolve).

    Conditions seen on several ranks at once are grouped: ``ranks`` lists every rank involved and
    ``rank`` is that rank when there is exactly one, else null. A group that gains ranks while
    firing is re-sent as ``firing`` with the longer list, so ``(key, status, incident, ranks,
    metrics)`` names a transition and lets consumers drop redeliveries.

    Conditions of one run that start at the same step from one cause (a NaN reaching loss, grad
    norm and weights) are one page: ``metrics`` then lists every metric involved (``metric`` and
    ``detector`` are the page's first, most severe condition); empty for a page of one condition.
    """

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
    ranks: tuple[int, ...] = ()
    metrics: tuple[str, ...] = ()  # added after schema 1: optional, empty for one condition

    KIND = "alert"
    TOPIC = ALERTS

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise SchemaError(f"alert status must be one of {STATUSES}, got {self.status!r}")
        if self.severity not in SEVERITIES:
            raise SchemaError(f"alert severity must be one of {SEVERITIES}, got {self.severity!r}")

    @staticmethod
    def make_key(run: str, detector: str, metric: str, rank: int | None = None) -> str:
        """``run/detector/metric`` for a group or the whole run, ``run/detector/metric/rank`` for one rank."""
        return f"{run}/{detector}/{metric}" if rank is None else f"{run}/{detector}/{metric}/{rank}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["value"], d["score"] = encode_float(self.value), encode_float(self.score)
        d["ranks"] = list(self.ranks)
        d["metrics"] = list(self.metrics)
        return {"schema": SCHEMA_VERSION, "kind": self.KIND, **d}

    def to_bytes(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> Alert:
        return cls.from_dict(loads(data, cls.KIND))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Alert:
        check_event(obj, cls.KIND)
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
            ts=ts_field(obj),
            score=float_field(obj, "score", 1.0),
            incident=field_of(obj, "incident", int) if "incident" in obj else 0,
            ranks=_ranks(obj),
            metrics=_metrics(obj),
        )


def _metrics(obj: dict[str, Any]) -> tuple[str, ...]:
    metrics = obj.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise SchemaError("field 'metrics' must be a list of strings")
    return tuple(metrics)


def _ranks(obj: dict[str, Any]) -> tuple[int, ...]:
    ranks = obj.get("ranks", [])
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise SchemaError("field 'ranks' must be a list of integers")
    return tuple(ranks)

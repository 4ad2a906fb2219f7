"""The wire contract: topic names and event schemas. Everything else imports this module.

Every event is one UTF-8 JSON object with ``schema`` (this module's ``SCHEMA_VERSION``) and ``kind``.
JSON has no NaN or infinity, and a NaN is exactly what an alert must be able to carry, so non-finite
floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (the names JavaScript and
Python's ``float()`` both read back). Any Kafka client can decode every rankwatch event.

Telemetry is batched: one message carries many steps of many metrics of one rank, column-wise
(``series[name] = {"steps": [...], "values": [...]}``), because per-message overhead, not per-value
work, dominates Kafka throughput. ``seq`` numbers the messages of one producer incarnation
(``producer``), so processors drop replays and the pipeline stays idempotent under at-least-once.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from rankwatch.errors import SchemaError

SCHEMA_VERSION = 1

TELEMETRY = "rankwatch.telemetry"
EVAL_SHARDS = "rankwatch.eval-shards"
ALERTS = "rankwatch.alerts"
REPORTS = "rankwatch.reports"
CONTROL = "rankwatch.control"
DEADLETTER = "rankwatch.deadletter"
TOPICS = (TELEMETRY, EVAL_SHARDS, ALERTS, REPORTS, CONTROL, DEADLETTER)

STATUSES = ("firing", "resolved")
SEVERITIES = ("info", "warning", "critical")

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(x: float) -> float | str:
    """A float as strict JSON allows it: finite floats unchanged, the rest as their names."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def decode_float(x: Any) -> float:
    if isinstance(x, bool):
        raise SchemaError(f"expected a number, got {x!r}")
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x in _NONFINITE:
        return _NONFINITE[x]
    raise SchemaError(f"expected a number or one of {sorted(_NONFINITE)}, got {x!r}")


def telemetry_key(run: str, rank: int) -> bytes:
    """Message key for a rank's telemetry: one rank's messages stay ordered on one partition."""
    return f"{run}/{rank}".encode()


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _loads(data: bytes, kind: str) -> dict[str, Any]:
    obj = decode_any(data)
    if type(obj.get("schema")) is not int or obj["schema"] != SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {obj.get('schema')!r} (this is {SCHEMA_VERSION})")
    if obj.get("kind") != kind:
        raise SchemaError(f"expected kind {kind!r}, got {obj.get('kind')!r}")
    return obj


def _field(obj: Mapping[str, Any], name: str, types: type | tuple[type, ...], *, nullable: bool = False):
    if name not in obj:
        raise SchemaError(f"missing field {name!r}")
    value = obj[name]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SchemaError(f"field {name!r} must be {types}, got bool")
    if not isinstance(value, types):
        raise SchemaError(f"field {name!r} must be {getattr(types, '__name__', types)}, got {type(value).__name__}")
    return value


def _float_field(obj: Mapping[str, Any], name: str, default: float | None = None) -> float:
    if name not in obj:
        if default is not None:
            return default
        raise SchemaError(f"missing field {name!r}")
    try:
        return decode_float(obj[name])
    except SchemaError as exc:
        raise SchemaError(f"field {name!r}: {exc}") from None


@dataclass(frozen=True)
class Series:
    """Consecutive points of one metric: ``steps`` (int64) and ``values`` (float64), same length."""

    steps: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class TelemetryBatch:
    run: str
    rank: int
    world_size: int
    producer: str
    seq: int
    ts: float
    series: dict[str, Series] = field(default_factory=dict)

    KIND = "telemetry"

    @property
    def key(self) -> bytes:
        return telemetry_key(self.run, self.rank)

    def to_bytes(self) -> bytes:
        return _dumps(
            {
                "schema": SCHEMA_VERSION,
                "kind": self.KIND,
                "run": self.run,
                "rank": self.rank,
                "world_size": self.world_size,
                "producer": self.producer,
                "seq": self.seq,
                "ts": self.ts,
                "series": {
                    name: {"steps": s.steps.tolist(), "values": [encode_float(v) for v in s.values.tolist()]}
                    for name, s in self.series.items()
                },
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> TelemetryBatch:
        obj = _loads(data, cls.KIND)
        rank = _field(obj, "rank", int)
        world_size = _field(obj, "world_size", int)
        if not 0 <= rank < world_size:
            raise SchemaError(f"rank {rank} outside world_size {world_size}")
        raw_series = _field(obj, "series", dict)
        series = {}
        for name, raw in raw_series.items():
            if not isinstance(raw, dict):
                raise SchemaError(f"series {name!r} must be an object")
            steps, values = _field(raw, "steps", list), _field(raw, "values", list)
            if len(steps) != len(values):
                raise SchemaError(f"series {name!r}: {len(steps)} steps but {len(values)} values")
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
                raise SchemaError(f"series {name!r}: steps must be integers")
            series[name] = Series(
                steps=np.asarray(steps, dtype=np.int64),
                values=np.fromiter((decode_float(v) for v in values), dtype=np.float64, count=len(values)),
            )
        return cls(
            run=_field(obj, "run", str),
            rank=rank,
            world_size=world_size,
            producer=_field(obj, "producer", str),
            seq=_field(obj, "seq", int),
            ts=float(_field(obj, "ts", (int, float))),
            series=series,
        )


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
        return _dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> Alert:
        obj = _loads(data, cls.KIND)
        return cls(
            key=_field(obj, "key", str),
            run=_field(obj, "run", str),
            status=_field(obj, "status", str),
            severity=_field(obj, "severity", str),
            detector=_field(obj, "detector", str),
            metric=_field(obj, "metric", str),
            rank=_field(obj, "rank", int, nullable=True),
            step=_field(obj, "step", int),
            value=_float_field(obj, "value"),
            message=_field(obj, "message", str),
            ts=float(_field(obj, "ts", (int, float))),
            score=_float_field(obj, "score", 1.0),
            incident=_field(obj, "incident", int) if "incident" in obj else 0,
        )


@dataclass(frozen=True)
class Rollup:
    """Summary of one metric of one rank over a closed window of steps ``[start_step, end_step)``."""

    run: str
    rank: int
    metric: str
    start_step: int
    end_step: int
    count: int
    nonfinite: int
    mean: float
    std: float
    min: float
    max: float
    last: float
    ts: float

    KIND = "rollup"

    def to_bytes(self) -> bytes:
        d = {k: encode_float(v) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return _dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, **d})

    @classmethod
    def from_bytes(cls, data: bytes) -> Rollup:
        obj = _loads(data, cls.KIND)
        floats = {"mean", "std", "min", "max", "last"}
        kwargs = {}
        for name in cls.__dataclass_fields__:
            if name in floats:
                kwargs[name] = _float_field(obj, name)
            elif name == "ts":
                kwargs[name] = float(_field(obj, name, (int, float)))
            else:
                kwargs[name] = _field(obj, name, str if name in ("run", "metric") else int)
        return cls(**kwargs)


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

    def to_bytes(self) -> bytes:
        return _dumps(
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
        obj = _loads(data, cls.KIND)
        return cls(
            reason=_field(obj, "reason", str),
            topic=_field(obj, "topic", str),
            partition=_field(obj, "partition", int),
            offset=_field(obj, "offset", int),
            payload=_b64(_field(obj, "payload_b64", str)),
            ts=float(_field(obj, "ts", (int, float))),
        )


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error
        raise SchemaError(f"field 'payload_b64' is not base64: {exc}") from None


def decode_any(data: bytes) -> dict[str, Any]:
    """Any rankwatch event as a plain dict (for display tools); raises SchemaError unless a UTF-8 JSON object."""
    try:
        obj = json.loads(data.decode("utf-8"))  # json.loads(bytes) would also guess UTF-16/32
    except (UnicodeDecodeError, ValueError) as exc:
        raise SchemaError(f"not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {type(obj).__name__}")
    return obj

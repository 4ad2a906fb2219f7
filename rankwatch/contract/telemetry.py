"""Rank telemetry (batched, column-wise) and its step-window rollups."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rankwatch.contract.binary import is_binary, pack_telemetry, unpack_telemetry
from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    check_event,
    decode_float,
    dumps,
    dumps_finite,
    encode_float,
    field_of,
    float_field,
    int64_array,
    loads,
    ts_field,
)
from rankwatch.contract.topics import REPORTS, TELEMETRY, URGENT
from rankwatch.errors import SchemaError

#: Metrics the publisher's sender thread adds to each heartbeat, which the processors read by name:
#: seconds since the rank last logged, and seconds it has been blocked in its oldest unfinished
#: collective (a stopped run's blocked ranks wait for the one that is not).
HEARTBEAT = "heartbeat_age_s"
COLLECTIVE_WAIT = "collective_wait_s"
#: The hook's per-step metric of how long the training thread waited for a CPU; stage 2 reads it to
#: say, with a straggler alert, that the rank's host was short of CPU.
CPU_WAIT = "cpu_wait_s"


def telemetry_key(run: str, rank: int) -> bytes:
    """Message key for a rank's telemetry: one rank's messages stay ordered on one partition."""
    return f"{run}/{rank}".encode()


@dataclass(frozen=True)
class Series:
    """Consecutive points of one metric: ``steps`` (int64) and ``values`` (float64), same length."""

    steps: np.ndarray
    values: np.ndarray


def encode_series(series: dict[str, Series]) -> dict:
    return {n: {"steps": s.steps.tolist(), "values": _encode_values(s.values)} for n, s in series.items()}


def _encode_values(values: np.ndarray) -> list[float | str]:
    # One vectorised check instead of a Python call per value: nearly every series is all finite.
    if np.isfinite(values).all():
        return values.tolist()
    return [encode_float(v) for v in values.tolist()]


def decode_series(raw_series: dict) -> dict[str, Series]:
    series = {}
    for name, raw in raw_series.items():
        if not isinstance(raw, dict):
            raise SchemaError(f"series {name!r} must be an object")
        steps, values = field_of(raw, "steps", list), field_of(raw, "values", list)
        if len(steps) != len(values):
            raise SchemaError(f"series {name!r}: {len(steps)} steps but {len(values)} values")
        series[name] = Series(steps=int64_array(steps, f"series {name!r}: steps"), values=_decode_values(values))
    return series


_PLAIN_NUMBERS = frozenset({float, int})


def _decode_values(values: list) -> np.ndarray:
    # Nearly every series is plain numbers: one conversion in C instead of a Python call per value
    # (issue 16). Bools and strings ("NaN", "Infinity") take the checked path, and so does anything
    # the fast one turns non-finite (a literal like 1e400, an integer too large for a float), to be
    # read or refused exactly as before.
    if _PLAIN_NUMBERS.issuperset(map(type, values)):
        try:
            array = np.array(values, dtype=np.float64)
        except OverflowError:
            array = None
        if array is not None and np.isfinite(array).all():
            return array
    return np.fromiter((decode_float(v) for v in values), dtype=np.float64, count=len(values))


@dataclass(frozen=True)
class TelemetryBatch:
    run: str
    rank: int
    world_size: int
    producer: str
    seq: int
    ts: float
    series: dict[str, Series] = field(default_factory=dict)
    final: bool = False  # the publisher is closing: the rank stops on purpose, not a stall

    KIND = "telemetry"
    TOPIC = TELEMETRY

    @property
    def key(self) -> bytes:
        return telemetry_key(self.run, self.rank)

    def to_dict(self) -> dict:
        """The JSON form as a plain dict (non-finite values as their names): what display tools show."""
        return {
            "schema": SCHEMA_VERSION,
            "kind": self.KIND,
            "run": self.run,
            "rank": self.rank,
            "world_size": self.world_size,
            "producer": self.producer,
            "seq": self.seq,
            "final": self.final,
            "ts": self.ts,
            "series": encode_series(self.series),
        }

    def to_bytes(self, *, binary: bool = False) -> bytes:
        """The JSON form (schema 1), or with ``binary`` the columnar one (schema 2, ``contract.binary``)."""
        if binary:
            header = {"run": self.run, "rank": self.rank, "world_size": self.world_size, "producer": self.producer,
                      "seq": self.seq, "final": self.final, "ts": self.ts}
            return pack_telemetry(header, {n: (s.steps, s.values) for n, s in self.series.items()})
        return dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> TelemetryBatch:
        """Either form, told apart by the first byte; SchemaError for anything that is neither."""
        if is_binary(data):
            fields = unpack_telemetry(data)
            fields["series"] = {n: Series(steps=st, values=v) for n, (st, v) in fields["series"].items()}
            return cls(**fields)
        obj = loads(data, cls.KIND)
        rank = field_of(obj, "rank", int)
        world_size = field_of(obj, "world_size", int)
        if not 0 <= rank < world_size:
            raise SchemaError(f"rank {rank} outside world_size {world_size}")
        raw_series = field_of(obj, "series", dict)
        series = decode_series(raw_series)
        return cls(
            run=field_of(obj, "run", str),
            rank=rank,
            world_size=world_size,
            producer=field_of(obj, "producer", str),
            seq=field_of(obj, "seq", int),
            final=field_of(obj, "final", bool) if "final" in obj else False,
            ts=ts_field(obj),
            series=series,
        )


@dataclass(frozen=True)
class UrgentTelemetry(TelemetryBatch):
    """The NaN lane, on ``rankwatch.urgent``: a metric's non-finite value that follows finite ones,
    after the finite points since its previous non-finite value (if that was recent), in the
    telemetry format. The publisher sends it ahead of the telemetry that carries the same points,
    so that a worker behind on telemetry pages at once; stage 1's transitions for them follow as
    replays. Keyed by run, like the run events it joins on the worker."""

    TOPIC = URGENT

    @property
    def key(self) -> bytes:
        return self.run.encode()


@dataclass(frozen=True)
class Rollup:
    """Summary of one metric of one rank over a closed window of steps ``[start_step, end_step)``.

    The fields after ``ts`` came later within schema 1: optional, so older messages still decode.
    ``first_step``/``last_step`` are the steps the window saw; ``p50``/``p95``/``p99`` come from
    ``sketch``, the window's t-digest centroids ``{"means": [...], "weights": [...]}``, which a
    reader merges across ranks or windows (``rankwatch.sketch.Sketch.from_wire``). A closing rank
    sends its open window early: a later rollup of the same window supersedes it.
    """

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
    first_step: int | None = None
    last_step: int | None = None
    world_size: int | None = None
    p50: float = math.nan
    p95: float = math.nan
    p99: float = math.nan
    sketch: dict | None = None

    KIND = "rollup"
    TOPIC = REPORTS

    @property
    def key(self) -> bytes:
        return telemetry_key(self.run, self.rank)

    def to_bytes(self) -> bytes:
        # Fields read directly: asdict() deep-copies the sketch's lists, which cost more than all the
        # rest of a worker's processing (issue 16); the sketch is not changed here, so no copy is needed.
        # Its means are finite (a sketch holds finite values; a reader refuses others) and every other
        # float is encoded here, so the faster encoder may write it: a rollup's JSON was 14% of a worker.
        d = {k: encode_float(v) if isinstance(v, float) else v
             for k in self.__dataclass_fields__ for v in (getattr(self, k),)}
        return dumps_finite({"schema": SCHEMA_VERSION, "kind": self.KIND, **d})

    @classmethod
    def from_bytes(cls, data: bytes) -> Rollup:
        return cls.from_dict(loads(data, cls.KIND))

    @classmethod
    def from_dict(cls, obj: dict) -> Rollup:
        """From the decoded JSON object (a reader that decoded it to learn its kind need not again)."""
        check_event(obj, cls.KIND)
        floats = {"mean", "std", "min", "max", "last"}
        kwargs = _rollup_extras(obj)
        for name in cls.__dataclass_fields__:
            if name in ROLLUP_EXTRAS:
                continue
            if name in floats:
                kwargs[name] = float_field(obj, name)
            elif name == "ts":
                kwargs[name] = ts_field(obj, name)
            else:
                kwargs[name] = field_of(obj, name, str if name in ("run", "metric") else int)
        return cls(**kwargs)


#: Rollup fields added within schema 1; absent from older messages.
ROLLUP_EXTRAS = ("first_step", "last_step", "world_size", "p50", "p95", "p99", "sketch")
MAX_CENTROIDS = 1000  # far above what rankwatch sends (100): a bound on what a reader accepts


def _rollup_extras(obj: dict) -> dict:
    out = {}
    for name in ("first_step", "last_step", "world_size"):
        if obj.get(name) is not None:
            out[name] = field_of(obj, name, int)
    for name in ("p50", "p95", "p99"):
        if name in obj:
            out[name] = float_field(obj, name)
    if obj.get("sketch") is not None:
        sketch = field_of(obj, "sketch", dict)
        means, weights = field_of(sketch, "means", list), field_of(sketch, "weights", list)
        if len(means) != len(weights) or len(means) > MAX_CENTROIDS:
            raise SchemaError(f"sketch: {len(means)} means and {len(weights)} weights (equal, at most {MAX_CENTROIDS})")
        values = [decode_float(v) for v in means + weights]
        if not all(math.isfinite(v) for v in values) or any(w <= 0 for w in values[len(means):]):
            raise SchemaError("sketch: means must be finite and weights positive")
        out["sketch"] = {"means": values[: len(means)], "weights": values[len(means):]}
    return out

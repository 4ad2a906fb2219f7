"""Telemetry's binary columnar encoding (schema 2): what ``RankPublisher`` writes by default.

JSON costs about 1.8 µs per value to write and read, which by itself caps a worker below a million
values a second (issue 16). This form keeps the fields of the JSON one and packs the points as raw
arrays: a message is the byte ``MAGIC`` (0xC1) followed by one msgpack map::

    {"schema": 2, "kind": "telemetry", "run": str, "rank": int, "world_size": int, "producer": str,
     "seq": int, "final": bool, "ts": float,
     "names": [str, ...],        # the metrics, in order, each once
     "counts": [int, ...],       # points per metric, aligned with names
     "steps": bin,               # every metric's steps, concatenated in names' order: little-endian int64
     "values": bin}              # the same for values: little-endian IEEE 754 float64, bit for bit

0xC1 can start neither a JSON text (JSON starts with ``{`` here, or whitespace) nor UTF-8 text, and
msgpack reserves it ("never used"), so a reader that sees only the value tells the two forms apart
by the first byte, and a plain JSON or msgpack parser refuses a binary message outright rather than
misreading it. Decoding is one ``numpy.frombuffer`` per column, with no work per value, so NaN
payloads, negative zero and the whole int64 range come back exactly.

>>> import numpy as np
>>> data = pack_telemetry(dict(run="r", rank=0, world_size=1, producer="p", seq=0, final=False, ts=1.0),
...                       {"loss": (np.array([7]), np.array([np.nan]))})
>>> data[:1] == MAGIC, unpack_telemetry(data)["series"]["loss"][1]
(True, array([nan]))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from rankwatch.contract.codec import check_size, field_of, reject_nul, ts_field
from rankwatch.errors import SchemaError

#: First byte of every binary telemetry message (JSON messages start with ``{``).
MAGIC = b"\xc1"
#: ``schema`` of the binary form; the JSON form stays ``SCHEMA_VERSION`` (1).
BINARY_SCHEMA_VERSION = 2
KIND = "telemetry"
#: The envelope's fields besides the points, with their types.
HEADER_FIELDS = {"run": str, "rank": int, "world_size": int, "producer": str, "seq": int, "final": bool}

_STEPS, _VALUES = np.dtype("<i8"), np.dtype("<f8")


def is_binary(data: bytes) -> bool:
    """Whether ``data`` is the binary form (else it is JSON, or garbage)."""
    return data[:1] == MAGIC


def pack_telemetry(header: Mapping[str, Any], series: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> bytes:
    """The binary message for ``header`` (``HEADER_FIELDS`` plus ``ts``) and ``{name: (steps, values)}``.

    ValueError if a metric's steps and values differ in length, or its steps are not integers.
    """
    names, counts = list(series), []
    for name, (steps, values) in series.items():
        if len(steps) != len(values):
            raise ValueError(f"series {name!r}: {len(steps)} steps but {len(values)} values")
        counts.append(len(steps))
    if names:
        try:  # same_kind: a float step is refused, not truncated
            steps = np.concatenate([s for s, _ in series.values()], dtype=_STEPS, casting="same_kind").tobytes()
        except TypeError as exc:
            raise ValueError(f"steps must be integers: {exc}") from None
        values = np.concatenate([v for _, v in series.values()], dtype=_VALUES).tobytes()
    else:
        steps = values = b""
    return MAGIC + msgpack.packb(
        {"schema": BINARY_SCHEMA_VERSION, "kind": KIND, **{k: header[k] for k in HEADER_FIELDS},
         "ts": float(header["ts"]), "names": names, "counts": counts, "steps": steps, "values": values},
        use_bin_type=True,
    )


def unpack_telemetry(data: bytes) -> dict[str, Any]:
    """``HEADER_FIELDS`` and ``ts`` of a binary message, and ``series``: ``{name: (steps, values)}``.

    The arrays are writable int64 and float64. SchemaError for anything that is not a valid
    binary telemetry message (and nothing else: a worker dead-letters what raises it).
    """
    check_size(len(data))  # before decoding: the cost of a decode grows with the message
    if not is_binary(data):
        raise SchemaError("not binary telemetry: it must start with the byte 0xC1")
    try:
        obj = msgpack.unpackb(memoryview(data)[1:], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, OverflowError) as exc:
        raise SchemaError(f"not msgpack: {type(exc).__name__}: {str(exc)[:80]}") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a msgpack map, got {type(obj).__name__}")
    if type(obj.get("schema")) is not int or obj["schema"] != BINARY_SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {obj.get('schema')!r} of binary telemetry "
                          f"(this is {BINARY_SCHEMA_VERSION})")
    if obj.get("kind") != KIND:
        raise SchemaError(f"expected kind {KIND!r}, got {obj.get('kind')!r}")
    out: dict[str, Any] = {name: field_of(obj, name, kind) for name, kind in HEADER_FIELDS.items()}
    reject_nul(out["run"], out["producer"])
    if not 0 <= out["rank"] < out["world_size"]:
        raise SchemaError(f"rank {out['rank']} outside world_size {out['world_size']}")
    out["ts"] = ts_field(obj)
    out["series"] = _unpack_series(obj)
    return out


def _unpack_series(obj: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    names, counts = field_of(obj, "names", list), field_of(obj, "counts", list)
    raw_steps, raw_values = field_of(obj, "steps", bytes), field_of(obj, "values", bytes)
    if len(names) != len(counts):
        raise SchemaError(f"{len(names)} names but {len(counts)} counts")
    if not all(type(n) is str for n in names) or len(set(names)) != len(names):
        raise SchemaError("names must be distinct strings")
    reject_nul(*names)
    if not all(type(c) is int and c >= 0 for c in counts):
        raise SchemaError("counts must be integers >= 0")
    total = sum(counts)
    if len(raw_steps) != 8 * total or len(raw_values) != 8 * total:
        raise SchemaError(f"counts add up to {total} points, but steps hold {len(raw_steps)} bytes and values "
                          f"{len(raw_values)} (8 per point)")
    # One copy per column: native byte order, writable like the arrays decoded from JSON.
    steps = np.frombuffer(raw_steps, dtype=_STEPS).astype(np.int64)
    values = np.frombuffer(raw_values, dtype=_VALUES).astype(np.float64)
    if names and counts.count(counts[0]) == len(counts):  # the usual batch: every metric at the same steps
        shape = (len(names), counts[0])  # iterating rows of a 2-D view is cheaper than slicing each
        return dict(zip(names, zip(steps.reshape(shape), values.reshape(shape))))
    series, at = {}, 0
    for name, count in zip(names, counts):
        series[name] = (steps[at : at + count], values[at : at + count])
        at += count
    return series

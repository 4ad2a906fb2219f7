"""Strict-JSON encoding helpers shared by every event type (telemetry's binary form: ``binary.py``)."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from rankwatch.errors import SchemaError

SCHEMA_VERSION = 1

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

#: Key plus value of one message, in bytes, on both ends: publishers refuse anything larger and
#: workers dead-letter it before decoding. Under Kafka's default 1 MiB request limit, so whatever a
#: publisher accepts every broker takes, and a worker never decodes (or re-sends) a giant.
MAX_MESSAGE_BYTES = 1_000_000

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class MessageTooLarge(SchemaError):
    """A message over ``MAX_MESSAGE_BYTES``: split it (fewer steps or samples per message)."""


def check_size(size: int, what: str = "message") -> None:
    """MessageTooLarge if a message of ``size`` bytes (key plus value) is over the limit."""
    if size > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(
            f"{what} of {size:,} bytes is over the limit of {MAX_MESSAGE_BYTES:,} bytes per message "
            "(rankwatch.contract.MAX_MESSAGE_BYTES); send it in smaller parts"
        )


def encode_float(x: float) -> float | str:
    """A float as strict JSON allows it: finite floats unchanged, the rest as their names."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def decode_float(x: Any) -> float:
    if isinstance(x, bool):
        raise SchemaError(f"expected a number, got {x!r}")
    if isinstance(x, float):
        if not math.isfinite(x):  # only a literal like 1e400 parses to one: non-finite numbers travel as names
            raise SchemaError(f"number out of range for a float: {x!r}")
        return x
    if isinstance(x, int):
        try:
            return float(x)
        except OverflowError:
            raise SchemaError(f"integer out of range for a float ({x.bit_length()} bits)") from None
    if isinstance(x, str) and x in NONFINITE:
        return NONFINITE[x]
    raise SchemaError(f"expected a number or one of {sorted(NONFINITE)}, got {_short(x)}")


def _short(x: Any) -> str:
    # Error messages end up in dead letters and logs: a 900 KB string must not travel in one.
    text = repr(x)
    return text if len(text) <= 80 else f"{text[:60]}… ({len(text):,} characters)"


def dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def dumps_finite(obj: Mapping[str, Any]) -> bytes:
    """``dumps`` for an object whose every float is finite, about five times faster on a rollup's
    sketch. The caller guarantees it: msgspec writes a NaN as null, where ``dumps`` refuses it."""
    return _encode(obj)


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):  # numpy scalars, which json takes as numbers
        return x.item()
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


_encode = msgspec.json.Encoder(enc_hook=_plain).encode


def loads(data: bytes, kind: str) -> dict[str, Any]:
    return check_event(decode_any(data), kind)


def check_event(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """``obj`` if it is a current-schema event of ``kind``, else SchemaError."""
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {type(obj).__name__}")
    if type(obj.get("schema")) is not int or obj["schema"] != SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {obj.get('schema')!r} (this is {SCHEMA_VERSION})")
    if obj.get("kind") != kind:
        raise SchemaError(f"expected kind {kind!r}, got {obj.get('kind')!r}")
    return obj


def field_of(obj: Mapping[str, Any], name: str, types: type | tuple[type, ...], *, nullable: bool = False):
    if name not in obj:
        raise SchemaError(f"missing field {name!r}")
    value = obj[name]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SchemaError(f"field {name!r} must be {types}, got bool")
    if not isinstance(value, types):
        raise SchemaError(f"field {name!r} must be {getattr(types, '__name__', types)}, got {type(value).__name__}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:  # every integer field is an int64
        raise SchemaError(f"field {name!r} is out of the int64 range")
    return value


def ts_field(obj: Mapping[str, Any], name: str = "ts") -> float:
    """A finite number, as a float (timestamps: a NaN one would make the events built from it unsendable)."""
    value = field_of(obj, name, (int, float))
    if not math.isfinite(value):
        raise SchemaError(f"field {name!r} must be finite, got {value!r}")
    return float(value)


_INT = frozenset({int})


def int64_array(values: list, what: str) -> np.ndarray:
    """A list of integers as int64; SchemaError for anything else."""
    # One C loop over the types (a JSON decoder makes no int subclass but bool): a generator with
    # two isinstance calls per value cost more than the conversion (issue 16).
    if not _INT.issuperset(map(type, values)):
        raise SchemaError(f"{what} must be integers")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise SchemaError(f"{what} must fit in int64") from None


def float_field(obj: Mapping[str, Any], name: str, default: float | None = None) -> float:
    if name not in obj:
        if default is not None:
            return default
        raise SchemaError(f"missing field {name!r}")
    try:
        return decode_float(obj[name])
    except SchemaError as exc:
        raise SchemaError(f"field {name!r}: {exc}") from None


def b64decode_field(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error
        raise SchemaError(f"field 'payload_b64' is not base64: {exc}") from None


def _bare_constant(name: str) -> Any:
    raise SchemaError(f"bare {name} token: non-finite numbers travel as the strings {sorted(NONFINITE)}")


def decode_any(data: bytes) -> dict[str, Any]:
    """Any rankwatch event as a plain dict (for display tools); raises SchemaError unless a UTF-8 JSON object
    or binary telemetry, which comes back as its JSON form (``TelemetryBatch.to_dict``)."""
    check_size(len(data))  # before decoding: the cost of a decode grows with the message
    if data[:1] == b"\xc1":  # contract.binary.MAGIC (that module imports this one)
        from rankwatch.contract.telemetry import TelemetryBatch

        return TelemetryBatch.from_bytes(data).to_dict()
    try:
        text = data.decode("utf-8")  # json.loads(bytes) would also guess UTF-16/32
        obj = json.loads(text, parse_constant=_bare_constant)
    except SchemaError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise SchemaError(f"not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise SchemaError("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {type(obj).__name__}")
    # UTF-8 cannot hold a lone surrogate, but a \uD800 escape can: keys built from such a string
    # would fail to encode far from here. The walk runs only when such an escape may be present.
    if "\\ud" in text or "\\uD" in text:
        _reject_lone_surrogates(obj)
    if "\\u0000" in text:
        reject_nul(*_strings(obj))
    return obj


def _strings(obj: Any):
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            yield item


def reject_nul(*strings: str) -> None:
    """A NUL in a run id or name would collide with the worker's own keys (its state tables keep
    parts of a key's value after a NUL), so no string of a message may hold one."""
    for item in strings:
        if "\x00" in item:
            raise SchemaError(f"string with a NUL character: {_short(item)}")


def _reject_lone_surrogates(obj: Any) -> None:
    for item in _strings(obj):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise SchemaError(f"string with a lone surrogate: {_short(item)}") from None


def encode_tree(obj: Any) -> Any:
    """Nested dicts/lists with every non-finite float replaced by its name (strict JSON)."""
    if isinstance(obj, float):
        return encode_float(obj)
    if isinstance(obj, dict):
        return {str(k): encode_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_tree(v) for v in obj]
    return obj


def decode_tree(obj: Any) -> Any:
    """``obj`` with the names of non-finite floats read back; SchemaError if nested too deeply."""
    try:
        return _decode_tree(obj)
    except RecursionError:
        raise SchemaError("JSON nested too deeply") from None


def _decode_tree(obj: Any) -> Any:
    if isinstance(obj, str) and obj in NONFINITE:
        return NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: _decode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_tree(v) for v in obj]
    return obj

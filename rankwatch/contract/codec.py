"""Strict-JSON encoding helpers shared by every event type."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

from rankwatch.errors import SchemaError

SCHEMA_VERSION = 1

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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
    if isinstance(x, str) and x in NONFINITE:
        return NONFINITE[x]
    raise SchemaError(f"expected a number or one of {sorted(NONFINITE)}, got {x!r}")


def dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


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
    return value


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


def decode_any(data: bytes) -> dict[str, Any]:
    """Any rankwatch event as a plain dict (for display tools); raises SchemaError unless a UTF-8 JSON object."""
    try:
        obj = json.loads(data.decode("utf-8"))  # json.loads(bytes) would also guess UTF-16/32
    except (UnicodeDecodeError, ValueError) as exc:
        raise SchemaError(f"not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


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
    if isinstance(obj, str) and obj in NONFINITE:
        return NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: decode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tree(v) for v in obj]
    return obj

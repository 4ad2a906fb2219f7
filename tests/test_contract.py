"""The wire contract: round-trips, strict JSON, and a SchemaError with a clear message for bad bytes."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from rankwatch import contract
from rankwatch.contract import (
    SCHEMA_VERSION,
    Alert,
    DeadLetter,
    Rollup,
    Series,
    TelemetryBatch,
    decode_any,
    decode_float,
    encode_float,
    telemetry_key,
)
from rankwatch.contract.telemetry import ROLLUP_EXTRAS
from rankwatch.errors import RankwatchError, SchemaError


def _strict_loads(data: bytes):
    """A parser that refuses NaN/Infinity literals, as strict JSON clients (and other languages) do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def _batch(**changes) -> TelemetryBatch:
    fields = dict(
        run="run-1",
        rank=3,
        world_size=8,
        producer="p-abc",
        seq=17,
        ts=1700000000.25,
        series={
            "loss": Series(
                steps=np.array([100, 101, 102, 103, 104], dtype=np.int64),
                values=np.array([2.5, np.nan, np.inf, -np.inf, -0.0]),
            ),
            "grad_norm": Series(steps=np.array([100], dtype=np.int64), values=np.array([1e-300])),
            "empty": Series(steps=np.array([], dtype=np.int64), values=np.array([], dtype=np.float64)),
        },
    )
    fields.update(changes)
    return TelemetryBatch(**fields)


def _alert(**changes) -> Alert:
    fields = dict(
        key=Alert.make_key("run-1", "nonfinite", "loss", 3),
        run="run-1",
        status="firing",
        severity="critical",
        detector="nonfinite",
        metric="loss",
        rank=3,
        step=101,
        value=math.nan,
        message="loss is NaN on rank 3 at step 101 (nonfinite)",
        ts=1700000000.5,
        score=1.0,
        incident=101,
    )
    fields.update(changes)
    return Alert(**fields)


def _rollup(**changes) -> Rollup:
    fields = dict(
        run="run-1", rank=3, metric="loss", start_step=100, end_step=150, count=48, nonfinite=2,
        mean=1.25, std=0.5, min=0.25, max=3.0, last=math.nan, ts=1700000001.0,
    )
    fields.update(changes)
    return Rollup(**fields)


def _deadletter(**changes) -> DeadLetter:
    fields = dict(
        reason="not UTF-8 JSON", topic=contract.TELEMETRY, partition=5, offset=123456,
        payload=b"\xff\x00{not json", ts=1700000002.0,
    )
    fields.update(changes)
    return DeadLetter(**fields)


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def _assert_same_batch(a: TelemetryBatch, b: TelemetryBatch) -> None:
    assert (a.run, a.rank, a.world_size, a.producer, a.seq, a.ts) == (b.run, b.rank, b.world_size, b.producer, b.seq, b.ts)
    assert list(a.series) == list(b.series)
    for name in a.series:
        assert b.series[name].steps.dtype == np.int64
        assert b.series[name].values.dtype == np.float64
        np.testing.assert_array_equal(a.series[name].steps, b.series[name].steps)
        np.testing.assert_array_equal(a.series[name].values, b.series[name].values)  # NaN == NaN here
        assert np.array_equal(np.signbit(a.series[name].values), np.signbit(b.series[name].values))


# --- floats and keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, wire", [(1.5, 1.5), (-0.0, -0.0), (math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")]
)
def test_encode_decode_float(x, wire):
    encoded = encode_float(x)
    if isinstance(wire, str):
        assert encoded == wire
    else:
        assert encoded == wire and isinstance(encoded, float)
    assert _same_float(decode_float(encoded), x)
    assert _same_float(float(encoded), x)  # Python's float() reads the names back too


@pytest.mark.parametrize("bad", [True, False, None, "nan", "inf", "1.0", [], {}])
def test_decode_float_rejects_non_numbers(bad):
    with pytest.raises(SchemaError, match=re.escape(repr(bad))):
        decode_float(bad)


def test_decode_float_accepts_ints():
    assert decode_float(3) == 3.0 and isinstance(decode_float(3), float)


def test_telemetry_key_is_run_and_rank():
    assert telemetry_key("run-1", 3) == b"run-1/3"
    assert _batch().key == b"run-1/3"


def test_topics_are_distinct_and_namespaced():
    assert len(set(contract.TOPICS)) == len(contract.TOPICS) == 6
    assert all(t.startswith("rankwatch.") for t in contract.TOPICS)


def test_schema_error_is_a_rankwatch_error_and_a_value_error():
    assert issubclass(SchemaError, RankwatchError) and issubclass(SchemaError, ValueError)


# --- round-trips -------------------------------------------------------------------------------


def test_telemetry_round_trip_keeps_nonfinite_values_and_dtypes():
    batch = _batch()
    _assert_same_batch(batch, TelemetryBatch.from_bytes(batch.to_bytes()))


def test_telemetry_round_trip_with_no_series():
    batch = _batch(series={})
    back = TelemetryBatch.from_bytes(batch.to_bytes())
    assert back.series == {} and back.seq == 17


def test_telemetry_wire_format_is_columnar():
    obj = _strict_loads(_batch().to_bytes())
    assert obj["schema"] == SCHEMA_VERSION and obj["kind"] == "telemetry"
    assert obj["series"]["loss"] == {"steps": [100, 101, 102, 103, 104], "values": [2.5, "NaN", "Infinity", "-Infinity", -0.0]}


def test_alert_round_trip_with_nan_value():
    alert = _alert()
    back = Alert.from_bytes(alert.to_bytes())
    assert math.isnan(back.value)
    assert back == _alert(value=back.value)  # every other field equal
    assert back.to_bytes() == alert.to_bytes()


@pytest.mark.parametrize("value", [math.inf, -math.inf, 0.0, 12.5])
def test_alert_round_trip_other_values_and_cross_rank(value):
    alert = _alert(rank=None, value=value, status="resolved", severity="info", key=Alert.make_key("r", "d", "m", None))
    back = Alert.from_bytes(alert.to_bytes())
    assert back == alert
    assert back.rank is None and back.key == "r/d/m"


def test_alert_score_and_incident_default_when_absent():
    obj = _alert().to_dict()
    del obj["score"], obj["incident"]
    back = Alert.from_bytes(json.dumps(obj).encode())
    assert (back.score, back.incident) == (1.0, 0)


def test_alert_make_key():
    assert Alert.make_key("r", "spike", "loss", 0) == "r/spike/loss/0"
    assert Alert.make_key("r", "spike", "loss", None) == "r/spike/loss"


def test_rollup_round_trip():
    rollup = _rollup()
    back = Rollup.from_bytes(rollup.to_bytes())
    assert math.isnan(back.last)
    assert back == _rollup(last=back.last)


def test_rollup_round_trip_of_an_empty_window():
    rollup = _rollup(count=0, nonfinite=3, mean=math.nan, std=0.0, min=math.nan, max=math.nan, last=math.inf)
    back = Rollup.from_bytes(rollup.to_bytes())
    assert all(math.isnan(v) for v in (back.mean, back.min, back.max))
    assert (back.count, back.nonfinite, back.std, back.last) == (0, 3, 0.0, math.inf)


def test_deadletter_round_trip_keeps_arbitrary_bytes():
    dl = _deadletter(payload=bytes(range(256)))
    back = DeadLetter.from_bytes(dl.to_bytes())
    assert back == dl


@pytest.mark.parametrize(
    "event",
    [_batch(), _batch(series={}), _alert(), _alert(value=-math.inf, rank=None), _rollup(),
     _rollup(count=0, mean=math.nan, min=math.nan, max=math.nan, last=-math.inf), _deadletter()],
    ids=lambda e: type(e).__name__,
)
def test_every_event_is_strict_utf8_json(event):
    data = event.to_bytes()
    assert isinstance(data, bytes)
    obj = _strict_loads(data)  # raises on NaN/Infinity literals or non-UTF-8
    assert obj["schema"] == SCHEMA_VERSION and obj["kind"] == event.KIND
    assert decode_any(data) == obj


# --- SchemaError -------------------------------------------------------------------------------

DECODERS = [TelemetryBatch, Alert, Rollup, DeadLetter]
GOOD = {TelemetryBatch: _batch, Alert: _alert, Rollup: _rollup, DeadLetter: _deadletter}


def _raw(cls) -> dict:
    return json.loads(GOOD[cls]().to_bytes())


def _bytes(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"{", b"\x00\x01", b"[1, 2]", b'"telemetry"', b"42", b"null"],
    ids=["empty", "text", "truncated", "binary", "array", "string", "number", "null"],
)
def test_non_json_or_non_object_raises(cls, data):
    with pytest.raises(SchemaError, match="JSON|object"):
        cls.from_bytes(data)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
def test_non_utf8_bytes_raise(cls):
    good = GOOD[cls]().to_bytes()
    latin1 = good.replace(b'"schema"', b'"\xe9schema"', 1)
    with pytest.raises(SchemaError, match="UTF-8"):
        cls.from_bytes(latin1)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_utf16_and_utf32_events_are_refused(cls, encoding):
    # The contract is UTF-8 JSON; a producer sending UTF-16 would be read here but not by other clients.
    data = json.dumps(_raw(cls)).encode(encoding)
    with pytest.raises(SchemaError, match="UTF-8"):
        cls.from_bytes(data)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("version", [0, 2, "1", 1.5, None, True], ids=repr)
def test_wrong_schema_version_raises(cls, version):
    obj = _raw(cls)
    obj["schema"] = version
    with pytest.raises(SchemaError, match="schema version"):
        cls.from_bytes(_bytes(obj))


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
def test_missing_schema_version_raises(cls):
    obj = _raw(cls)
    del obj["schema"]
    with pytest.raises(SchemaError, match="schema version None"):
        cls.from_bytes(_bytes(obj))


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
def test_wrong_kind_raises(cls):
    other = {TelemetryBatch: Alert, Alert: Rollup, Rollup: DeadLetter, DeadLetter: TelemetryBatch}[cls]
    with pytest.raises(SchemaError, match=f"expected kind '{cls.KIND}', got '{other.KIND}'"):
        cls.from_bytes(GOOD[other]().to_bytes())
    obj = _raw(cls)
    del obj["kind"]
    with pytest.raises(SchemaError, match="expected kind"):
        cls.from_bytes(_bytes(obj))


# Fields added after schema 1 shipped are optional, so older producers stay valid.
OPTIONAL = {(Alert, "score"), (Alert, "incident"), (Alert, "ranks"), (Alert, "metrics"), (TelemetryBatch, "final"),
            (DeadLetter, "payload_size"), (DeadLetter, "payload_sha256"), (DeadLetter, "truncated"),
            *((Rollup, name) for name in ROLLUP_EXTRAS)}
REQUIRED = [
    (cls, name)
    for cls in DECODERS
    for name in _raw(cls)
    if name not in ("schema", "kind") and (cls, name) not in OPTIONAL
]


@pytest.mark.parametrize("cls, name", REQUIRED, ids=[f"{c.__name__}.{n}" for c, n in REQUIRED])
def test_missing_field_raises_naming_it(cls, name):
    obj = _raw(cls)
    del obj[name]
    with pytest.raises(SchemaError, match=f"missing field '{name}'"):
        cls.from_bytes(_bytes(obj))


@pytest.mark.parametrize("name", ["steps", "values"])
def test_missing_series_column_raises_naming_it(name):
    obj = _raw(TelemetryBatch)
    del obj["series"]["loss"][name]
    with pytest.raises(SchemaError, match=f"missing field '{name}'"):
        TelemetryBatch.from_bytes(_bytes(obj))


WRONG_TYPES = [
    (TelemetryBatch, "run", 5),
    (TelemetryBatch, "rank", "3"),
    (TelemetryBatch, "rank", 3.0),
    (TelemetryBatch, "world_size", "8"),
    (TelemetryBatch, "producer", None),
    (TelemetryBatch, "seq", "17"),
    (TelemetryBatch, "seq", 17.5),
    (TelemetryBatch, "ts", "now"),
    (TelemetryBatch, "series", []),
    (Alert, "key", 1),
    (Alert, "run", None),
    (Alert, "status", 1),
    (Alert, "rank", "3"),
    (Alert, "step", "101"),
    (Alert, "step", None),
    (Alert, "message", ["x"]),
    (Alert, "ts", "now"),
    (Alert, "score", "high"),
    (Alert, "score", None),
    (Alert, "incident", "101"),
    (Alert, "incident", 101.5),
    (Rollup, "metric", 1),
    (Rollup, "start_step", "100"),
    (Rollup, "count", 48.0),
    (Rollup, "ts", None),
    (DeadLetter, "topic", 1),
    (DeadLetter, "partition", "5"),
    (DeadLetter, "offset", None),
    (DeadLetter, "payload_b64", 7),
]


@pytest.mark.parametrize(
    "cls, name, bad", WRONG_TYPES, ids=[f"{c.__name__}.{n}={b!r}" for c, n, b in WRONG_TYPES]
)
def test_wrong_type_raises_naming_the_field(cls, name, bad):
    obj = _raw(cls)
    obj[name] = bad
    with pytest.raises(SchemaError, match=f"'{name}'"):
        cls.from_bytes(_bytes(obj))


WRONG_FLOATS = [
    (Alert, "value", "big"),
    (Alert, "value", None),
    (Alert, "value", True),
    (Rollup, "mean", "1.0"),
    (Rollup, "max", False),
    (Rollup, "last", "nan"),
]


@pytest.mark.parametrize(
    "cls, name, bad", WRONG_FLOATS, ids=[f"{c.__name__}.{n}={b!r}" for c, n, b in WRONG_FLOATS]
)
def test_wrong_float_raises_showing_the_value(cls, name, bad):
    obj = _raw(cls)
    obj[name] = bad
    with pytest.raises(SchemaError, match=re.escape(repr(bad))):
        cls.from_bytes(_bytes(obj))


BOOLS = [
    (TelemetryBatch, "rank"),
    (TelemetryBatch, "world_size"),
    (TelemetryBatch, "seq"),
    (TelemetryBatch, "ts"),
    (Alert, "rank"),
    (Alert, "step"),
    (Alert, "ts"),
    (Alert, "incident"),
    (Rollup, "rank"),
    (Rollup, "start_step"),
    (Rollup, "end_step"),
    (Rollup, "count"),
    (Rollup, "nonfinite"),
    (DeadLetter, "partition"),
    (DeadLetter, "offset"),
]


@pytest.mark.parametrize("cls, name", BOOLS, ids=[f"{c.__name__}.{n}" for c, n in BOOLS])
@pytest.mark.parametrize("flag", [True, False])
def test_bool_where_int_expected_raises(cls, name, flag):
    obj = _raw(cls)
    obj[name] = flag
    with pytest.raises(SchemaError, match=f"'{name}'.*bool"):
        cls.from_bytes(_bytes(obj))


def test_bool_step_in_series_raises():
    obj = _raw(TelemetryBatch)
    obj["series"]["loss"]["steps"][0] = True
    with pytest.raises(SchemaError, match="'loss'.*integers"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("steps", [[1.0], ["1"], [None], [[1]]], ids=repr)
def test_non_integer_series_steps_raise(steps):
    obj = _raw(TelemetryBatch)
    obj["series"]["grad_norm"]["steps"] = steps
    with pytest.raises(SchemaError, match="'grad_norm'.*integers"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("bad", [True, "inf", None, [1.0], {"v": 1}], ids=repr)
def test_bad_series_value_raises(bad):
    obj = _raw(TelemetryBatch)
    obj["series"]["grad_norm"]["values"] = [bad]
    with pytest.raises(SchemaError, match=re.escape(repr(bad))):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("raw", [[1, 2], "x", None, 3], ids=repr)
def test_series_entry_not_an_object_raises(raw):
    obj = _raw(TelemetryBatch)
    obj["series"]["loss"] = raw
    with pytest.raises(SchemaError, match="series 'loss' must be an object"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("column", ["steps", "values"])
def test_series_column_not_a_list_raises(column):
    obj = _raw(TelemetryBatch)
    obj["series"]["loss"][column] = "1,2,3"
    with pytest.raises(SchemaError, match=f"'{column}'"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("n_steps, n_values", [(3, 2), (2, 3), (0, 1), (1, 0)])
def test_steps_values_length_mismatch_raises(n_steps, n_values):
    obj = _raw(TelemetryBatch)
    obj["series"]["loss"] = {"steps": list(range(n_steps)), "values": [1.0] * n_values}
    with pytest.raises(SchemaError, match=f"'loss': {n_steps} steps but {n_values} values"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("rank, world_size", [(8, 8), (9, 8), (-1, 8), (0, 0), (0, -1)])
def test_rank_outside_world_size_raises(rank, world_size):
    obj = _raw(TelemetryBatch)
    obj["rank"], obj["world_size"] = rank, world_size
    with pytest.raises(SchemaError, match=f"rank {rank} outside world_size {world_size}"):
        TelemetryBatch.from_bytes(_bytes(obj))


@pytest.mark.parametrize("rank, world_size", [(0, 1), (7, 8)])
def test_rank_at_the_edges_of_world_size_is_accepted(rank, world_size):
    obj = _raw(TelemetryBatch)
    obj["rank"], obj["world_size"] = rank, world_size
    back = TelemetryBatch.from_bytes(_bytes(obj))
    assert (back.rank, back.world_size) == (rank, world_size)


@pytest.mark.parametrize("status", ["open", "FIRING", "", "resolving"])
def test_bad_alert_status_raises(status):
    with pytest.raises(SchemaError, match=f"status must be one of .*got '{status}'"):
        _alert(status=status)
    obj = _raw(Alert)
    obj["status"] = status
    with pytest.raises(SchemaError, match="status"):
        Alert.from_bytes(_bytes(obj))


@pytest.mark.parametrize("severity", ["error", "CRITICAL", "", "fatal"])
def test_bad_alert_severity_raises(severity):
    with pytest.raises(SchemaError, match=f"severity must be one of .*got '{severity}'"):
        _alert(severity=severity)
    obj = _raw(Alert)
    obj["severity"] = severity
    with pytest.raises(SchemaError, match="severity"):
        Alert.from_bytes(_bytes(obj))


@pytest.mark.parametrize("status", contract.STATUSES)
@pytest.mark.parametrize("severity", contract.SEVERITIES)
def test_every_status_and_severity_is_accepted(status, severity):
    alert = _alert(status=status, severity=severity, value=1.0)
    assert Alert.from_bytes(alert.to_bytes()) == alert


@pytest.mark.parametrize("payload_b64", ["abc", "!!!!", "a"], ids=repr)
def test_deadletter_bad_base64_raises_schema_error(payload_b64):
    obj = _raw(DeadLetter)
    obj["payload_b64"] = payload_b64
    with pytest.raises(SchemaError, match="payload_b64"):
        DeadLetter.from_bytes(_bytes(obj))


def test_decode_any_reads_every_kind_and_rejects_non_objects():
    for make in GOOD.values():
        event = make()
        assert decode_any(event.to_bytes())["kind"] == event.KIND
    with pytest.raises(SchemaError, match="JSON"):
        decode_any(b"\xff\xfe\x00")
    with pytest.raises(SchemaError, match="object"):
        decode_any(b"[]")


def test_a_rollup_of_schema_1_as_first_shipped_still_decodes():
    old = (b'{"schema":1,"kind":"rollup","run":"r","rank":0,"metric":"m","start_step":0,"end_step":10,"count":1,'
           b'"nonfinite":0,"mean":1.0,"std":0.0,"min":1.0,"max":1.0,"last":1.0,"ts":1.0}')
    r = Rollup.from_bytes(old)
    assert (r.sketch, r.world_size, r.first_step) == (None, None, None) and math.isnan(r.p99)


@pytest.mark.parametrize("sketch", [{"means": [1.0], "weights": []}, {"means": ["NaN"], "weights": [1.0]},
                                    {"means": [1.0], "weights": [0.0]}, {"means": [1.0]}])
def test_a_malformed_rollup_sketch_is_rejected(sketch):
    obj = json.loads(Rollup(run="r", rank=0, metric="m", start_step=0, end_step=10, count=1, nonfinite=0, mean=1.0,
                            std=0.0, min=1.0, max=1.0, last=1.0, ts=1.0).to_bytes())
    with pytest.raises(SchemaError):
        Rollup.from_bytes(json.dumps({**obj, "sketch": sketch}).encode())

"""The wire contract: round-trips, strict JSON, and a SchemaError with a clear message for bad bytes."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from contract_samples import alert as _alert
from contract_samples import batch as _batch
from contract_samples import deadletter as _deadletter
from contract_samples import rollup as _rollup

from rankwatch import contract
from rankwatch.contract import (
    SCHEMA_VERSION,
    Alert,
    DeadLetter,
    Rollup,
    TelemetryBatch,
    decode_any,
    decode_float,
    encode_float,
    telemetry_key,
)
from rankwatch.contract.codec import dumps
from rankwatch.errors import RankwatchError, SchemaError


def _strict_loads(data: bytes):
    """A parser that refuses NaN/Infinity literals, as strict JSON clients (and other languages) do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


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
    assert len(set(contract.TOPICS)) == len(contract.TOPICS) == 7
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


def test_rollup_round_trip_with_a_sketch_and_numpy_floats():
    # Rollups are written by msgspec (codec.dumps_finite), the rest by json: the same JSON either way.
    sketch = {"means": [0.25, 1e-05, 3.0], "weights": [1.0, 46.0, 1.0]}
    rollup = _rollup(p50=np.float64(1.5), p99=math.inf, sketch=sketch)
    data = rollup.to_bytes()
    fields = {k: encode_float(float(v)) if isinstance(v, float) else v for k, v in vars(rollup).items()}
    assert json.loads(data) == json.loads(dumps({"schema": SCHEMA_VERSION, "kind": "rollup", **fields}))
    back = Rollup.from_bytes(data)
    assert (back.p50, back.p99, back.sketch) == (1.5, math.inf, rollup.sketch)


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

"""The wire contract's SchemaError: every malformed event is refused with a message that names what is wrong."""

from __future__ import annotations

import json
import math
import re

import pytest
from contract_samples import alert as _alert
from contract_samples import batch as _batch
from contract_samples import deadletter as _deadletter
from contract_samples import rollup as _rollup

from rankwatch import contract
from rankwatch.contract import (
    Alert,
    DeadLetter,
    Rollup,
    TelemetryBatch,
    decode_any,
)
from rankwatch.contract.telemetry import ROLLUP_EXTRAS
from rankwatch.errors import SchemaError


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


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("where", ["run", "metric"])
def test_a_nul_character_in_a_run_or_metric_is_refused(binary, where):
    """The worker's state tables keep parts of a value under ``key + NUL``: no message may make one."""
    good = _batch()
    run, series = good.run, dict(good.series)
    if where == "run":
        run = "a\x00b"
    else:
        series["loss\x00x"] = series.pop(next(iter(series)))
    bad = TelemetryBatch(run=run, rank=good.rank, world_size=good.world_size, producer=good.producer, seq=good.seq,
                         ts=good.ts, series=series)
    with pytest.raises(SchemaError, match="NUL character"):
        TelemetryBatch.from_bytes(bad.to_bytes(binary=binary))

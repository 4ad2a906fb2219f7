"""Telemetry's binary form (schema 2): exact round-trips, both forms read by one decoder, SchemaError for bad
bytes, and the publisher writing it unless told to keep JSON."""

from __future__ import annotations

import json
import math
import struct
import tempfile

import msgpack
import numpy as np
import pytest

from rankwatch import contract
from rankwatch.contract import SchemaError, Series, TelemetryBatch, decode_any
from rankwatch.contract.binary import BINARY_SCHEMA_VERSION, MAGIC, is_binary
from rankwatch.contract.codec import INT64_MAX, INT64_MIN
from rankwatch.producers import RankPublisher
from rankwatch.producers.spool import SpoolReader
from rankwatch.settings import Settings

NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]


def _batch(**changes) -> TelemetryBatch:
    fields = dict(
        run="run-ü/1", rank=3, world_size=8, producer="host:0:12:abcd", seq=2**40, ts=1700000000.123456789,
        series={
            "loss": Series(np.array([100, 101, 102, 103, 104, 105], dtype=np.int64),
                           np.array([2.5, np.nan, np.inf, -np.inf, -0.0, NAN_PAYLOAD])),
            "grad_norm/層": Series(np.array([INT64_MIN, 0, INT64_MAX], dtype=np.int64), np.array([1e-300, 5e-324, 1e308])),
            "empty": Series(np.array([], dtype=np.int64), np.array([], dtype=np.float64)),
            "😀": Series(np.array([7], dtype=np.int64), np.array([-1.5])),
        },
        final=True,
    )
    fields.update(changes)
    return TelemetryBatch(**fields)


def _same(a: TelemetryBatch, b: TelemetryBatch) -> None:
    """Every field equal; arrays bit for bit (NaN payloads and the sign of zero included), in the same order."""
    for name in ("run", "rank", "world_size", "producer", "seq", "ts", "final"):
        assert getattr(a, name) == getattr(b, name) and type(getattr(a, name)) is type(getattr(b, name)), name
    assert list(a.series) == list(b.series)
    for name, s in a.series.items():
        t = b.series[name]
        assert t.steps.dtype == np.int64 and t.values.dtype == np.float64
        assert s.steps.tobytes() == t.steps.tobytes() and s.values.tobytes() == t.values.tobytes(), name


def _raw(batch: TelemetryBatch) -> dict:
    return msgpack.unpackb(batch.to_bytes(binary=True)[1:])


def _pack(obj) -> bytes:
    return MAGIC + msgpack.packb(obj, use_bin_type=True)


def test_every_field_round_trips_exactly():
    original = _batch()
    data = original.to_bytes(binary=True)
    assert data[:1] == MAGIC and is_binary(data) and _raw(original)["schema"] == BINARY_SCHEMA_VERSION
    back = TelemetryBatch.from_bytes(data)
    _same(original, back)
    assert back.to_bytes(binary=True) == data  # stable: a re-encode is the same bytes


@pytest.mark.parametrize("changes", [
    {"series": {}}, {"final": False}, {"ts": 0}, {"rank": 0, "world_size": 1}, {"seq": INT64_MAX},
    {"series": {"heartbeat_age_s": Series(np.array([12]), np.array([0.25])),
                "rss_bytes": Series(np.array([12]), np.array([3.2e9]))}},
    {"series": {"a": Series(np.arange(3), np.ones(3)), "b": Series(np.arange(5), np.zeros(5))}},  # uneven counts
], ids=["no-series", "not-final", "int-ts", "one-rank", "max-seq", "heartbeat", "uneven"])
def test_round_trip_cases(changes):
    original = _batch(**changes)
    back = TelemetryBatch.from_bytes(original.to_bytes(binary=True))
    _same(replace_ts(original), back)


def replace_ts(batch: TelemetryBatch) -> TelemetryBatch:
    """The batch as it travels: ``ts`` is a float on the wire in both forms."""
    from dataclasses import replace
    return replace(batch, ts=float(batch.ts))


def test_decoded_arrays_are_writable_like_json_ones():
    back = TelemetryBatch.from_bytes(_batch().to_bytes(binary=True))
    for s in back.series.values():
        s.values[:] = 0.0
        s.steps[:] = 0
    assert all(not s.values.any() for s in back.series.values())


def test_both_forms_decode_to_the_same_batch_and_the_same_json_view():
    original = _batch()
    from_json = TelemetryBatch.from_bytes(original.to_bytes())
    from_binary = TelemetryBatch.from_bytes(original.to_bytes(binary=True))
    for name, s in from_json.series.items():  # JSON keeps values, not NaN payloads
        assert np.array_equal(s.values, from_binary.series[name].values, equal_nan=True)
        assert np.array_equal(np.signbit(s.values), np.signbit(from_binary.series[name].values))
    # What display tools (rankwatch tail, record) show: the JSON form, whichever form travelled.
    assert decode_any(original.to_bytes(binary=True)) == json.loads(original.to_bytes()) == decode_any(original.to_bytes())
    assert TelemetryBatch.from_bytes(json.dumps(decode_any(original.to_bytes(binary=True))).encode()).final


def test_the_first_byte_tells_the_forms_apart():
    assert _batch().to_bytes()[:1] == b"{"
    # 0xC1 starts no UTF-8 text (so no JSON text, even with a BOM or whitespace) and is msgpack's "never used".
    with pytest.raises(UnicodeDecodeError):
        MAGIC.decode("utf-8")
    with pytest.raises(ValueError):
        json.loads(_batch().to_bytes(binary=True))
    with pytest.raises(msgpack.FormatError):
        msgpack.unpackb(_batch().to_bytes(binary=True))
    # Every other event stays JSON, and refuses binary telemetry as the wrong kind.
    with pytest.raises(SchemaError, match="expected kind"):
        contract.Alert.from_bytes(_batch().to_bytes(binary=True))


def test_encoding_refuses_a_series_that_could_not_decode():
    with pytest.raises(ValueError, match="3 steps but 2 values"):
        _batch(series={"x": Series(np.arange(3), np.ones(2))}).to_bytes(binary=True)
    with pytest.raises(ValueError, match="integers"):
        _batch(series={"x": Series(np.array([1.5]), np.ones(1))}).to_bytes(binary=True)


def _changed(**fields) -> bytes:
    return _pack({**_raw(_batch()), **fields})


BAD = {
    "unknown version": _changed(schema=3),
    "schema 1 in binary": _changed(schema=1),
    "schema as float": _changed(schema=2.0),
    "other kind": _changed(kind="alert"),
    "rank outside world": _changed(rank=8),
    "rank as string": _changed(rank="3"),
    "final as int": _changed(final=1),
    "seq over int64": _changed(seq=2**64 - 1),
    "NaN ts": _changed(ts=math.nan),
    "steps as list": _changed(steps=[1, 2]),
    "values as str": _changed(values="x" * 8),
    "missing values": _pack({k: v for k, v in _raw(_batch()).items() if k != "values"}),
    "fewer counts than names": _changed(counts=[6, 3, 0]),
    "negative count": _changed(counts=[7, 3, -1, 1]),
    "count as bool": _changed(counts=[6, 3, False, 1]),
    "counts and bytes disagree": _changed(counts=[6, 3, 1, 1]),
    "steps shorter than values": _changed(steps=_raw(_batch())["steps"][:-8]),
    "bytes not a multiple of 8": _changed(steps=_raw(_batch())["steps"] + b"\0", values=_raw(_batch())["values"] + b"\0"),
    "duplicate names": _changed(names=["loss", "loss", "empty", "x"]),
    "name not a string": _changed(names=["loss", 1, "empty", "x"]),
    "a list, not a map": _pack([2, "telemetry"]),
    "int map keys": MAGIC + msgpack.packb({1: 2}),
    "an extension type": _changed(run=msgpack.ExtType(5, b"x")),
    "a timestamp": _changed(ts=msgpack.Timestamp(1, 2)),
    "trailing bytes": _batch().to_bytes(binary=True) + b"\x00",
    "magic alone": MAGIC,
    "invalid UTF-8 in a string": _changed(run="r").replace(b"\xa3run\xa1r", b"\xa3run\xa1\xff"),
    "deeply nested": MAGIC + b"\x91" * 100_000 + b"\x01",
}


@pytest.mark.parametrize("name", BAD)
def test_malformed_binary_raises_schema_error(name):
    for decode in (TelemetryBatch.from_bytes, decode_any):
        with pytest.raises(SchemaError):
            decode(BAD[name])


def test_every_truncation_raises_schema_error():
    data = _batch().to_bytes(binary=True)
    for n in range(1, len(data)):
        with pytest.raises(SchemaError):
            TelemetryBatch.from_bytes(data[:n])


def test_too_large_is_refused_before_decoding():
    big = MAGIC + b"\x00" * contract.MAX_MESSAGE_BYTES
    with pytest.raises(contract.MessageTooLarge):
        TelemetryBatch.from_bytes(big)


def _spooled_values(**kwargs) -> list[bytes]:
    """What a publisher with no broker leaves in its spool for its shipper: the bytes that reach the topic."""
    pub = RankPublisher(run="wire", rank=0, world_size=1, bootstrap="127.0.0.1:1", drain_s=0, connect_timeout_s=0.2,
                        spool_dir=tempfile.mkdtemp(), samplers=[], **kwargs)
    pub.log({"loss": 0.5, "nan": math.nan}, step=3)
    pub.close(timeout_s=5)
    return [r.value for r in SpoolReader(pub.spool).read(0) if r.topic == contract.TELEMETRY]


def test_the_publisher_writes_binary_by_default_and_json_when_asked():
    [binary] = _spooled_values()
    batch = TelemetryBatch.from_bytes(binary)
    assert is_binary(binary) and batch.final and math.isnan(batch.series["nan"].values[0])
    [text] = _spooled_values(telemetry_format="json")
    assert text[:1] == b"{" and json.loads(text)["series"]["nan"]["values"] == ["NaN"]
    with pytest.raises(ValueError, match="telemetry_format"):
        _spooled_values(telemetry_format="xml")


def test_rankwatch_telemetry_format_setting():
    assert Settings().telemetry_format == "binary"
    assert Settings.from_env({"RANKWATCH_TELEMETRY_FORMAT": "json"}).telemetry_format == "json"
    with pytest.raises(ValueError, match="telemetry_format"):
        Settings.from_env({"RANKWATCH_TELEMETRY_FORMAT": "msgpack"})
    pub = RankPublisher.from_env({"RANKWATCH_RUN": "wire", "RANKWATCH_TELEMETRY_FORMAT": "json",
                                  "RANKWATCH_BOOTSTRAP": "127.0.0.1:1", "RANKWATCH_SPOOL_DIR": tempfile.mkdtemp()},
                                 rank=0, world_size=1, drain_s=0, connect_timeout_s=0.2, samplers=[])
    try:
        assert pub.telemetry_format == "json"
    finally:
        pub.close(timeout_s=5)


@pytest.mark.broker
def test_binary_telemetry_through_worker_tail_record_and_replay(stack, run_id, tmp_path, capsys):
    """What a publisher writes by default is alerted on by a worker, shown by ``tail`` and recorded and
    replayed by ``record``/``replay`` as JSON."""
    from conftest import consume_json

    from rankwatch.cli import main

    with RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=stack.bootstrap, spool_dir=tmp_path / "spool",
                       samplers=[]) as pub:
        for step in range(5):
            pub.log({"loss": 1.0 / (step + 1)}, step=step)
        pub.log({"loss": math.nan}, step=5)
    assert pub.stats().sent >= 1

    def nan_alert(run: str) -> list[dict]:
        return consume_json(stack.bootstrap, contract.ALERTS, lambda a: a["run"] == run and a["detector"] == "nonfinite")

    assert nan_alert(run_id), "the worker raised no alert on binary telemetry"

    capsys.readouterr()
    assert main(["tail", contract.TELEMETRY, "--bootstrap", stack.bootstrap]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = [obj for obj in shown if obj.get("run") == run_id]
    assert ours and all(obj["schema"] == 1 for obj in ours)  # each as its JSON form
    assert "NaN" in [v for obj in ours for v in obj["series"].get("loss", {}).get("values", [])]

    path = tmp_path / "run.jsonl"
    assert main(["record", "--run", run_id, str(path), "--bootstrap", stack.bootstrap]) == 0
    assert json.loads(path.read_text().splitlines()[0])["counts"]["telemetry"] == len(ours)
    new = f"{run_id}-again"
    assert main(["replay", str(path), "--run", new, "--bootstrap", stack.bootstrap]) == 0
    assert nan_alert(new), "the replayed run raised no alert"

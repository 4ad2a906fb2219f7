"""Property-based fuzzing of every decoder in the contract: bytes in, an event or SchemaError out,
for JSON and for telemetry's binary form.

A decoder that raises anything else stops the stream that calls it (issue 15: a RecursionError, an
OverflowError). What decodes must also be usable: it re-encodes, and its key encodes.
"""

from __future__ import annotations

import json
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwatch import contract
from rankwatch.contract import (
    Alert,
    Control,
    DeadLetter,
    EvalReport,
    EvalShard,
    RankProgress,
    RankSignal,
    Rollup,
    SchemaError,
    Series,
    SignalBatch,
    TelemetryBatch,
)
from rankwatch.contract.binary import MAGIC

# No example database: the checkout stays clean, and every run draws afresh.
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _telemetry() -> TelemetryBatch:
    return TelemetryBatch(run="r", rank=1, world_size=2, producer="p", seq=3, ts=1.5,
                          series={"loss": Series(np.arange(3), np.array([1.0, math.nan, 2.0]))})


def _alert() -> Alert:
    return Alert(key="r/nonfinite/loss/1", run="r", status="firing", severity="critical", detector="nonfinite",
                 metric="loss", rank=1, step=5, value=math.nan, message="m", ts=2.0, ranks=(1,))


SAMPLES = {
    TelemetryBatch: _telemetry(),
    Alert: _alert(),
    Rollup: Rollup(run="r", rank=0, metric="loss", start_step=0, end_step=10, count=10, nonfinite=0,
                   mean=1.0, std=0.5, min=0.0, max=2.0, last=1.0, ts=3.0),
    DeadLetter: DeadLetter("invalid telemetry: x", contract.TELEMETRY, 0, 1, b"\xff", 4.0),
    EvalShard: EvalShard(run="r", eval_id="e", step=10, rank=0, world_size=2, chunk=0, last=True,
                         sample_ids=np.arange(3), metrics={"correct": np.array([1.0, 0.0, 1.0])}, ts=5.0,
                         dataset_size=6),
    EvalReport: EvalReport(run="r", eval_id="e", step=10, complete=True, provisional=False, revision=1,
                           world_size=2, ranks_received=[0, 1], missing_ranks=[], n_samples=6,
                           metrics={"correct": {"n": 6, "mean": 0.5, "method": "wilson"}},
                           per_rank={"0": {"correct": {"n": 3, "mean": 0.5}}}, composite=None,
                           coverage={"expected": 6, "received": 6}, ts=6.0),
    Control: Control(run="r", action="set_eval_interval", eval_id=None, value=100.0, reason="x", ts=7.0),
    RankSignal: RankSignal(alert=_alert(), world_size=2),
    SignalBatch: SignalBatch(run="r", items=(RankSignal(alert=_alert(), world_size=2),) * 2),
    RankProgress: RankProgress(run="r", rank=1, world_size=2, last_step=4, ts=8.0,
                               series={"loss": Series(np.arange(2), np.array([1.0, 2.0]))}, restarted=True),
}
if hasattr(contract, "RunUpdate"):  # moving into the contract while this was written
    SAMPLES[contract.RunUpdate] = contract.RunUpdate(report=SAMPLES[EvalReport])

DECODERS = {cls.__name__: cls.from_bytes for cls in SAMPLES}
DECODERS["decode_run_event"] = contract.decode_run_event
DECODERS["decode_any"] = contract.decode_any
DECODERS["Alert.from_dict"] = lambda data: Alert.from_dict(contract.decode_any(data))


def _holds(decode, data: bytes) -> None:
    """The property: SchemaError, or an event that re-encodes and whose key encodes."""
    try:
        event = decode(data)
    except SchemaError:
        return
    if hasattr(event, "to_bytes"):
        assert isinstance(event.to_bytes(), bytes)
    if hasattr(event, "key"):
        key = event.key
        assert isinstance(key.encode() if isinstance(key, str) else key, bytes)


# Values that broke decoders (issue 15), then anything else JSON can say.
NASTY = [2**63, -(2**63) - 1, 10**400, math.nan, math.inf, -math.inf, "NaN", "Infinity", "\ud800", "a\udfff",
         "", None, True, -1, [], {}, [[[]]]]
SCALARS = st.one_of(
    st.sampled_from(NASTY), st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.sampled_from(["firing", "critical", "set_eval_interval", "loss"]),
)
KEYS = st.one_of(st.text(max_size=6), st.sampled_from(["\ud800", "loss", "steps", "values"]))
TREES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(KEYS, kids, max_size=4),
                     max_leaves=12)


def _as_bytes(obj) -> bytes:
    # allow_nan: bare NaN/Infinity tokens are part of what others may send
    return json.dumps(obj, allow_nan=True).encode()


@pytest.mark.parametrize("name", DECODERS)
@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes_decode_or_raise_schema_error(name, data):
    _holds(DECODERS[name], data)


@pytest.mark.parametrize("name", DECODERS)
@FUZZ
@given(tree=TREES)
def test_any_json_tree_decodes_or_raises_schema_error(name, tree):
    _holds(DECODERS[name], _as_bytes(tree))


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda c: c.__name__)
@FUZZ
@given(changes=st.dictionaries(st.text(max_size=12), TREES, max_size=3), picks=st.data())
def test_a_valid_event_with_fields_changed_decodes_or_raises_schema_error(cls, changes, picks):
    obj = json.loads(SAMPLES[cls].to_bytes())
    # Mostly the event's own fields (and the ones nested one level down), so decoding gets far.
    for _ in range(picks.draw(st.integers(1, 3))):
        name = picks.draw(st.sampled_from(sorted(obj)))
        if isinstance(obj[name], dict) and obj[name] and picks.draw(st.booleans()):
            inner = picks.draw(st.sampled_from(sorted(obj[name])))
            obj[name][inner] = picks.draw(TREES)
        else:
            obj[name] = picks.draw(TREES)
    obj.update({k: v for k, v in changes.items() if k not in ("schema", "kind")})
    for decode in (cls.from_bytes, contract.decode_any):
        _holds(decode, _as_bytes(obj))


def _fields(obj: dict):
    """(container, name) for every field and every field one level down."""
    for name, value in obj.items():
        yield obj, name
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                yield value, inner
                if isinstance(inner_value, dict):  # a series: steps and values
                    yield from ((inner_value, n) for n in inner_value)


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda c: c.__name__)
def test_every_field_of_every_event_with_each_nasty_value(cls):
    # A sweep, not a draw: each value that once broke a decoder, in each field of each event.
    fields = list(_fields(json.loads(SAMPLES[cls].to_bytes())))
    for i in range(len(fields)):
        for nasty in NASTY:
            obj = json.loads(SAMPLES[cls].to_bytes())
            container, name = list(_fields(obj))[i]
            container[name] = nasty
            _holds(cls.from_bytes, _as_bytes(obj))


@pytest.mark.parametrize("cls", [TelemetryBatch, RankProgress], ids=lambda c: c.__name__)
@FUZZ
@given(steps=st.lists(SCALARS, max_size=4), values=st.lists(SCALARS, max_size=4))
def test_any_series_decodes_or_raises_schema_error(cls, steps, values):
    obj = json.loads(SAMPLES[cls].to_bytes())
    obj["series"]["loss"] = {"steps": steps, "values": values}
    _holds(cls.from_bytes, _as_bytes(obj))


@pytest.mark.parametrize("name", DECODERS)
def test_deep_nesting_raises_schema_error(name):
    for depth in (900, 5_000, 100_000):
        for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
            _holds(DECODERS[name], opening * depth + b"1" + closing * depth)
        obj = json.loads(SAMPLES.get(getattr(DECODERS[name], "__self__", None), SAMPLES[EvalReport]).to_bytes())
        _holds(DECODERS[name], json.dumps(obj)[:-1].encode() + b',"deep":' + b"[" * depth + b"]" * depth + b"}")


@pytest.mark.parametrize("name", DECODERS)
def test_a_message_over_the_limit_is_refused_before_decoding(name):
    too_big = b'{"pad":"' + b"x" * contract.MAX_MESSAGE_BYTES + b'"}'
    with pytest.raises(contract.MessageTooLarge, match="over the limit"):
        DECODERS[name](too_big)


# --- telemetry's binary form (schema 2): the same promise for bytes that start with its magic byte ---------

BINARY_DECODERS = {name: DECODERS[name] for name in ("TelemetryBatch", "decode_any", "decode_run_event", "Alert")}
BYTES = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\x00" * 7, b"\x00" * 8, b"\xff" * 16]))
BINARY_TREES = st.recursive(SCALARS | BYTES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(KEYS, kids, max_size=4),
                            max_leaves=12)


def _packed(obj) -> bytes | None:
    """MAGIC plus msgpack of ``obj``; lone surrogates go through as bytes (a reader must refuse them).
    None for an int over 64 bits: msgpack cannot say it, so no writer can send it."""
    try:
        return MAGIC + msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    except (OverflowError, ValueError):
        return None


def _binary_fields() -> dict:
    return msgpack.unpackb(SAMPLES[TelemetryBatch].to_bytes(binary=True)[1:])


def _holds_binary(data: bytes | None) -> None:
    """``_holds`` for every decoder, and a binary telemetry batch that decodes re-encodes to the same batch."""
    if data is None:
        return
    for decode in BINARY_DECODERS.values():
        _holds(decode, data)
    try:
        batch = TelemetryBatch.from_bytes(data)
    except SchemaError:
        return
    again = TelemetryBatch.from_bytes(batch.to_bytes(binary=True))
    assert again.to_bytes(binary=True) == batch.to_bytes(binary=True)


@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes_after_the_magic_byte_decode_or_raise_schema_error(data):
    _holds_binary(MAGIC + data)


@FUZZ
@given(tree=BINARY_TREES)
def test_any_msgpack_tree_after_the_magic_byte_decodes_or_raises_schema_error(tree):
    _holds_binary(_packed(tree))


@FUZZ
@given(changes=st.dictionaries(st.text(max_size=8), BINARY_TREES, max_size=2), picks=st.data())
def test_a_valid_binary_batch_with_fields_changed_decodes_or_raises_schema_error(changes, picks):
    obj = _binary_fields()
    for _ in range(picks.draw(st.integers(1, 3))):
        obj[picks.draw(st.sampled_from(sorted(obj)))] = picks.draw(BINARY_TREES)
    obj.update({k: v for k, v in changes.items() if k not in ("schema", "kind")})
    _holds_binary(_packed(obj))


@FUZZ
@given(names=st.lists(st.one_of(st.text(max_size=4), SCALARS), max_size=4),
       counts=st.lists(st.one_of(st.integers(-2, 6), SCALARS), max_size=4), steps=BYTES, values=BYTES)
def test_any_binary_columns_decode_or_raise_schema_error(names, counts, steps, values):
    _holds_binary(_packed({**_binary_fields(), "names": names, "counts": counts, "steps": steps, "values": values}))


def test_every_binary_field_with_each_nasty_value():
    for name in _binary_fields():
        for nasty in [*NASTY, b"", b"\x00" * 8, msgpack.ExtType(1, b"x"), msgpack.Timestamp(0, 1), {"a": [1]}]:
            _holds_binary(_packed({**_binary_fields(), name: nasty}))
        _holds_binary(_packed({k: v for k, v in _binary_fields().items() if k != name}))  # and without it


def test_every_cut_of_a_binary_batch_raises_schema_error():
    data = SAMPLES[TelemetryBatch].to_bytes(binary=True)
    for n in range(len(data)):
        with pytest.raises(SchemaError):
            TelemetryBatch.from_bytes(data[:n])

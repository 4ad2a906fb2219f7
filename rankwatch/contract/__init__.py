"""The wire contract: topic names and event schemas. Everything else imports this module.

Every event is one UTF-8 JSON object with ``schema`` (this module's ``SCHEMA_VERSION``) and ``kind``.
JSON has no NaN or infinity, and a NaN is exactly what an alert must be able to carry, so non-finite
floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (the names JavaScript and
Python's ``float()`` both read back). Any Kafka client can decode every rankwatch event.

Telemetry also has a binary columnar form (schema 2, ``rankwatch.contract.binary``): the byte 0xC1,
which no JSON text starts with, then a msgpack map whose points are raw little-endian int64/float64
arrays. ``RankPublisher`` writes it by default; ``TelemetryBatch.from_bytes`` reads either form, and
``decode_any`` shows a binary message as its JSON form.

A message (key plus value) is at most ``MAX_MESSAGE_BYTES``: publishers refuse a larger one with
``MessageTooLarge``, and workers dead-letter one without decoding it. Integers are int64.

Telemetry is batched: one message carries many steps of many metrics of one rank, column-wise
(``series[name] = {"steps": [...], "values": [...]}``), because per-message overhead, not per-value
work, dominates Kafka throughput. ``seq`` numbers the messages of one producer incarnation
(``producer``), so processors drop replays and the pipeline stays idempotent under at-least-once.
"""

from rankwatch.contract.alerts import SEVERITIES, STATUSES, Alert
from rankwatch.contract.codec import (
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    MessageTooLarge,
    check_size,
    decode_any,
    decode_float,
    encode_float,
)
from rankwatch.contract.deadletter import DeadLetter
from rankwatch.contract.evaluation import (
    CONTROL_ACTIONS,
    Control,
    EvalReport,
    EvalShard,
    eval_key,
)
from rankwatch.contract.internal import (
    Finding, ProgressBatch, RankProgress, RankSignal, RunUpdate, SignalBatch, decode_run_event,
)
from rankwatch.contract.telemetry import (
    COLLECTIVE_WAIT,
    CPU_WAIT,
    HEARTBEAT,
    Rollup,
    Series,
    TelemetryBatch,
    UrgentTelemetry,
    telemetry_key,
)
from rankwatch.contract.topics import (
    ALERTS,
    CONTROL,
    DEADLETTER,
    EVAL_SHARDS,
    INTERNAL_TOPICS,
    REPORTS,
    RUN_EVENTS,
    TELEMETRY,
    TOPICS,
    URGENT,
)
from rankwatch.errors import SchemaError

__all__ = [
    "SCHEMA_VERSION", "MAX_MESSAGE_BYTES", "MessageTooLarge", "check_size",
    "TOPICS", "TELEMETRY", "EVAL_SHARDS", "ALERTS", "REPORTS", "CONTROL", "DEADLETTER", "URGENT",
    "STATUSES", "SEVERITIES", "CONTROL_ACTIONS", "SchemaError",
    "Series", "TelemetryBatch", "UrgentTelemetry", "Rollup", "Alert", "DeadLetter", "EvalShard", "EvalReport", "Control",
    "RankSignal", "SignalBatch", "RankProgress", "ProgressBatch", "RunUpdate", "Finding", "decode_run_event",
    "RUN_EVENTS", "INTERNAL_TOPICS",
    "HEARTBEAT", "COLLECTIVE_WAIT", "CPU_WAIT", "telemetry_key", "eval_key", "encode_float", "decode_float",
    "decode_any",
]

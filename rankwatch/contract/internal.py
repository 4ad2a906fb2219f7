"""Events between the processors' stages (key: run). Not for outside consumers.

On ``RUN_EVENTS``: stage 1 is keyed by (run, rank) and scales with ranks; stage 2 is keyed by run
and sees every rank of a run, which grouping, cross-rank comparison and stall detection need.

On ``EVAL_RUN_EVENTS``: an evaluation is merged where its shards land (key ``run/eval_id``), but
alerts about a run must have one writer, so every non-provisional report travels on to the run's
own partition as a ``RunUpdate``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rankwatch.contract.alerts import Alert
from rankwatch.contract.codec import (
    SCHEMA_VERSION, decode_any, decode_tree, dumps, encode_tree, field_of, loads, ts_field,
)
from rankwatch.contract.evaluation import EvalReport
from rankwatch.contract.telemetry import Series, decode_series, encode_series
from rankwatch.contract.topics import EVAL_RUN_EVENTS, RUN_EVENTS
from rankwatch.errors import SchemaError


@dataclass(frozen=True)
class RankSignal:
    """One rank's condition changed (``alert`` has that rank); stage 2 groups it with its peers.
    ``urgent``: from the NaN lane (``UrgentTelemetry``), ahead of stage 1, whose own signal follows."""

    alert: Alert
    world_size: int
    urgent: bool = False

    KIND = "rank_signal"
    TOPIC = RUN_EVENTS

    @property
    def key(self) -> bytes:
        return self.alert.run.encode()

    def to_bytes(self) -> bytes:
        return dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, **self.to_dict()})

    def to_dict(self) -> dict:
        extra = {"urgent": True} if self.urgent else {}
        return {"world_size": self.world_size, "alert": self.alert.to_dict(), **extra}

    @classmethod
    def from_bytes(cls, data: bytes) -> RankSignal:
        return cls.from_dict(loads(data, cls.KIND))

    @classmethod
    def from_dict(cls, obj: dict) -> RankSignal:
        return cls(alert=Alert.from_dict(field_of(obj, "alert", dict)), world_size=field_of(obj, "world_size", int),
                   urgent=field_of(obj, "urgent", bool) if "urgent" in obj else False)


@dataclass(frozen=True)
class _RunBatch:
    """Several events of one run in one message, in order (``items``, each of run ``run``)."""

    run: str
    items: tuple

    TOPIC = RUN_EVENTS

    @property
    def key(self) -> bytes:
        return self.run.encode()

    def to_bytes(self) -> bytes:
        return dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, "run": self.run,
                      "items": [i.to_dict() for i in self.items]})

    @classmethod
    def from_bytes(cls, data: bytes) -> _RunBatch:
        obj = loads(data, cls.KIND)
        run = field_of(obj, "run", str)
        items = []
        for raw in field_of(obj, "items", list):
            if not isinstance(raw, dict):
                raise SchemaError(f"{cls.KIND} items must be objects")
            item = cls.ITEM.from_dict(raw)
            if cls.run_of(item) != run:
                raise SchemaError(f"{cls.KIND} of run {run!r} holds an item of run {cls.run_of(item)!r}")
            items.append(item)
        return cls(run=run, items=tuple(items))


@dataclass(frozen=True)
class SignalBatch(_RunBatch):
    """The ``RankSignal``s one telemetry message raised, in order. Stage 2 applies them together, so
    that a page one of them completes goes out with the conditions the others start: a NaN in one
    rank's batch makes its gradient (all-reduced: every rank's) and its loss NaN in one message, and
    that is one page naming the rank, not a page on every rank's gradient and then an update."""

    items: tuple[RankSignal, ...]

    KIND = "signal_batch"
    ITEM = RankSignal

    @staticmethod
    def run_of(item: RankSignal) -> str:
        return item.alert.run


@dataclass(frozen=True)
class RankProgress:
    """One rank's telemetry batch was applied: how far it got, when it was sent, and the values of
    the metrics that stage 2 compares across ranks, and of the waits it reads (``COLLECTIVE_WAIT``,
    ``CPU_WAIT``) (``series``; may be empty)."""

    run: str
    rank: int
    world_size: int
    last_step: int
    ts: float
    series: dict[str, Series]
    final: bool = False  # the rank's publisher closed: stop watching it for stalls
    partition: int = -1  # of the telemetry topic, where stage 1 read it (-1: not known)
    # The first batch of a new incarnation of the rank (a new publisher id): its steps may start
    # below the last ones seen (resumed from a checkpoint) and still be progress.
    restarted: bool = False

    KIND = "rank_progress"
    TOPIC = RUN_EVENTS

    @property
    def key(self) -> bytes:
        return self.run.encode()

    def to_bytes(self) -> bytes:
        return dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, **self.to_dict()})

    def to_dict(self) -> dict:
        d = {
            "run": self.run, "rank": self.rank, "world_size": self.world_size, "last_step": self.last_step,
            "ts": self.ts, "series": encode_series(self.series), "final": self.final, "partition": self.partition,
        }
        if self.restarted:  # rare: absent is what an older worker sent
            d["restarted"] = True
        return d

    @classmethod
    def from_bytes(cls, data: bytes) -> RankProgress:
        return cls.from_dict(loads(data, cls.KIND))

    @classmethod
    def from_dict(cls, obj: dict) -> RankProgress:
        return cls(
            run=field_of(obj, "run", str), rank=field_of(obj, "rank", int),
            world_size=field_of(obj, "world_size", int), last_step=field_of(obj, "last_step", int),
            ts=ts_field(obj), series=decode_series(field_of(obj, "series", dict)),
            final=field_of(obj, "final", bool) if "final" in obj else False,
            partition=field_of(obj, "partition", int) if "partition" in obj else -1,
            restarted=field_of(obj, "restarted", bool) if "restarted" in obj else False,
        )


@dataclass(frozen=True)
class ProgressBatch(_RunBatch):
    """Several ``RankProgress`` of one run, in the order stage 1 applied them: a worker that takes
    telemetry in batches sends one of these per run per batch instead of one event per message."""

    items: tuple[RankProgress, ...]

    KIND = "progress_batch"
    ITEM = RankProgress

    @staticmethod
    def run_of(item: RankProgress) -> str:
        return item.run


_RUN_EVENTS = {RankProgress.KIND: RankProgress, ProgressBatch.KIND: ProgressBatch, SignalBatch.KIND: SignalBatch}


def decode_run_event(data: bytes) -> RankSignal | SignalBatch | RankProgress | ProgressBatch:
    """Any event of ``RUN_EVENTS``, by its kind."""
    kind = decode_any(data).get("kind")
    return _RUN_EVENTS.get(kind, RankSignal).from_bytes(data)


@dataclass(frozen=True)
class Finding:
    """One anomalous condition seen in one evaluation; becomes an alert if it is not firing yet."""

    detector: str  # eval_consistency, eval_coverage, eval_regression
    metric: str
    rank: int | None
    value: float
    score: float
    severity: str
    message: str


@dataclass(frozen=True)
class RunUpdate:
    """A non-provisional report, its findings, and which (detector, metric) pairs were checked:
    a firing condition resolves only when its check ran again and found nothing."""

    report: EvalReport
    findings: list[Finding] = field(default_factory=list)
    evaluated: list[tuple[str, str]] = field(default_factory=list)

    KIND = "run_update"
    TOPIC = EVAL_RUN_EVENTS

    @property
    def key(self) -> bytes:
        return self.report.run.encode()

    def to_bytes(self) -> bytes:
        return dumps({
            "schema": SCHEMA_VERSION, "kind": self.KIND,
            "report": self.report.to_dict(),
            "findings": [encode_tree(asdict(f)) for f in self.findings],
            "evaluated": [list(pair) for pair in self.evaluated],
        })

    @classmethod
    def from_bytes(cls, data: bytes) -> RunUpdate:
        obj = loads(data, cls.KIND)
        report = EvalReport.from_bytes(dumps(field_of(obj, "report", dict)))
        try:
            findings = [Finding(**decode_tree(f)) for f in field_of(obj, "findings", list)]
            evaluated = [(d, m) for d, m in field_of(obj, "evaluated", list)]
        except (ValueError, TypeError) as exc:
            raise SchemaError(f"invalid run update: {exc}") from None
        return cls(report, findings, evaluated)

"""Distributed evaluation: per-rank shards in, global reports and control advice out."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rankwatch.contract.codec import (
    SCHEMA_VERSION,
    decode_float,
    decode_tree,
    dumps,
    encode_float,
    encode_tree,
    field_of,
    float_field,
    int64_array,
    loads,
    ts_field,
)
from rankwatch.contract.topics import CONTROL, EVAL_SHARDS, REPORTS
from rankwatch.errors import SchemaError


def eval_key(run: str, eval_id: str) -> bytes:
    """Message key of everything about one evaluation: all its shards meet on one partition."""
    return f"{run}/{eval_id}".encode()


@dataclass(frozen=True)
class EvalShard:
    """One chunk of one rank's slice of an evaluation: per-sample results, column-wise.

    ``metrics[name]`` is aligned with ``sample_ids`` (e.g. ``correct`` 0/1, ``reward``, ``length``).
    A rank may send its slice in several chunks (``chunk`` = 0, 1, …; ``last`` on the final one) so
    results stream while evaluation runs. Sample ids are global across ranks, which is how
    duplicates, gaps and replays are recognised.
    """

    run: str
    eval_id: str
    step: int
    rank: int
    world_size: int
    chunk: int
    last: bool
    sample_ids: np.ndarray
    metrics: dict[str, np.ndarray]
    ts: float
    dataset_size: int | None = None  # samples in the whole validation set, when the sender knows

    KIND = "eval_shard"
    TOPIC = EVAL_SHARDS

    @property
    def key(self) -> bytes:
        return eval_key(self.run, self.eval_id)

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "schema": SCHEMA_VERSION, "kind": self.KIND, "run": self.run, "eval_id": self.eval_id,
                "step": self.step, "rank": self.rank, "world_size": self.world_size, "chunk": self.chunk,
                "last": self.last, "sample_ids": np.asarray(self.sample_ids).tolist(),
                "metrics": {k: [encode_float(v) for v in np.asarray(a, dtype=np.float64).tolist()]
                            for k, a in self.metrics.items()},
                "ts": self.ts, "dataset_size": self.dataset_size,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> EvalShard:
        obj = loads(data, cls.KIND)
        rank, world_size = field_of(obj, "rank", int), field_of(obj, "world_size", int)
        if not 0 <= rank < world_size:
            raise SchemaError(f"rank {rank} outside world_size {world_size}")
        ids = field_of(obj, "sample_ids", list)
        sample_ids = int64_array(ids, "sample_ids")
        metrics = {}
        for name, values in field_of(obj, "metrics", dict).items():
            if not isinstance(values, list) or len(values) != len(ids):
                raise SchemaError(f"metric {name!r} must be a list as long as sample_ids ({len(ids)})")
            metrics[name] = np.fromiter((decode_float(v) for v in values), dtype=np.float64, count=len(values))
        return cls(
            run=field_of(obj, "run", str), eval_id=field_of(obj, "eval_id", str), step=field_of(obj, "step", int),
            rank=rank, world_size=world_size, chunk=field_of(obj, "chunk", int), last=field_of(obj, "last", bool),
            sample_ids=sample_ids, metrics=metrics,
            ts=ts_field(obj),
            dataset_size=field_of(obj, "dataset_size", int, nullable=True) if "dataset_size" in obj else None,
        )


@dataclass(frozen=True)
class EvalReport:
    """The global report of one evaluation, merged from every rank's shards.

    ``metrics[name]`` = ``{"n", "mean", "std", "ci_low", "ci_high", "method"}`` (95% CI; method
    names the interval, e.g. ``wilson`` for 0/1 metrics, ``t`` for continuous ones).
    ``per_rank[str(rank)][name]`` = ``{"n", "mean"}``. ``revision`` grows with every re-emission
    of the same evaluation (provisional, deadline-incomplete, amended by a late shard).
    ``coverage`` = ``{"expected", "received", "missing_ids", "duplicate_ids"}`` (id lists capped).
    """

    run: str
    eval_id: str
    step: int
    complete: bool
    provisional: bool
    revision: int
    world_size: int
    ranks_received: list[int]
    missing_ranks: list[int]
    n_samples: int
    metrics: dict[str, dict[str, Any]]
    per_rank: dict[str, dict[str, dict[str, Any]]]
    composite: float | None
    coverage: dict[str, Any]
    ts: float

    KIND = "eval_report"
    TOPIC = REPORTS

    @property
    def key(self) -> bytes:
        return eval_key(self.run, self.eval_id)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "kind": self.KIND, **encode_tree(asdict(self))}

    def to_bytes(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> EvalReport:
        obj = decode_tree(loads(data, cls.KIND))
        try:
            return cls(**{name: obj[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise SchemaError(f"missing field {exc.args[0]!r}") from None


CONTROL_ACTIONS = ("stop_eval", "set_eval_interval")


@dataclass(frozen=True)
class Control:
    """Advice from the processors back to the trainers (key: run).

    ``stop_eval``: evaluation ``eval_id`` has a tight enough CI; ranks may stop early.
    ``set_eval_interval``: evaluate every ``value`` steps from now on (adaptive frequency).
    Trainers follow advice only when configured to, within their own bounds.
    """

    run: str
    action: str
    eval_id: str | None
    value: float | None
    reason: str
    ts: float

    KIND = "control"
    TOPIC = CONTROL

    @property
    def key(self) -> bytes:
        return self.run.encode()

    def __post_init__(self) -> None:
        if self.action not in CONTROL_ACTIONS:
            raise SchemaError(f"control action must be one of {CONTROL_ACTIONS}, got {self.action!r}")

    def to_bytes(self) -> bytes:
        return dumps({"schema": SCHEMA_VERSION, "kind": self.KIND, **encode_tree(asdict(self))})

    @classmethod
    def from_bytes(cls, data: bytes) -> Control:
        obj = loads(data, cls.KIND)
        value = obj.get("value")
        return cls(
            run=field_of(obj, "run", str), action=field_of(obj, "action", str),
            eval_id=field_of(obj, "eval_id", str, nullable=True), reason=field_of(obj, "reason", str),
            value=None if value is None else float_field(obj, "value"), ts=ts_field(obj),
        )

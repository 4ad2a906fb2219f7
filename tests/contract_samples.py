"""Valid contract events, one per kind, that tests change one field at a time."""

from __future__ import annotations

import math

import numpy as np

from rankwatch import contract
from rankwatch.contract import Alert, DeadLetter, Rollup, Series, TelemetryBatch


def batch(**changes) -> TelemetryBatch:
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


def alert(**changes) -> Alert:
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


def rollup(**changes) -> Rollup:
    fields = dict(
        run="run-1", rank=3, metric="loss", start_step=100, end_step=150, count=48, nonfinite=2,
        mean=1.25, std=0.5, min=0.25, max=3.0, last=math.nan, ts=1700000001.0,
    )
    fields.update(changes)
    return Rollup(**fields)


def deadletter(**changes) -> DeadLetter:
    fields = dict(
        reason="not UTF-8 JSON", topic=contract.TELEMETRY, partition=5, offset=123456,
        payload=b"\xff\x00{not json", ts=1700000002.0,
    )
    fields.update(changes)
    return DeadLetter(**fields)

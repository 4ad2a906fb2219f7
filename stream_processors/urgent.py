"""The NaN lane: a rank's non-finite value of a metric, as the transition stage 1 will send.

At cluster scale a worker can be seconds behind on telemetry, and a NaN waits behind the backlog.
The publisher therefore also sends it on ``rankwatch.urgent`` (``UrgentTelemetry``), and a worker
turns it into the ``nonfinite`` signal stage 1 would send for it, marked ``urgent`` so that stage 2
pages without waiting for the other ranks to catch up (``grouping``). Stage 1's own signal, when it
comes, is a replay: same key, incident, message and severity, made by the same alert policy.

Only rules that fire on the first non-finite point qualify: with ``for`` > 1 or a ``cooldown``,
stage 1 may not fire on this point, and a lane signal that stage 1 never follows would stay firing.

Pure: no Faust, no clock.
"""

from __future__ import annotations

import numpy as np

from rankwatch.contract import RankSignal, TelemetryBatch
from rankwatch.stream_processors.detectors import NonFinite
from rankwatch.stream_processors.policies import AlertPolicy, Condition
from rankwatch.stream_processors.rules import Rules


def urgent_signals(rules: Rules, batch: TelemetryBatch, now: float) -> list[RankSignal]:
    """The urgent transitions of each metric of ``batch`` (``UrgentTelemetry``) that has a non-finite value.

    A series that starts with finite points is the calm since the metric's previous non-finite
    value: the rank's condition was firing before them, and it resolved within them if they are at
    least the rule's ``resolve_after``. The resolution is marked with the step before the calm
    began, which is at or after its incident, so that stage 1's own resolution counts as its replay.
    """
    signals = []
    for metric, series in batch.series.items():
        rule = rules.for_metric(metric).get(NonFinite.name)
        if rule is None or rule.for_ != 1 or rule.cooldown:
            continue
        anomalous = ~np.isfinite(series.values)
        if not anomalous.any():
            continue
        condition = Condition() if anomalous[0] else Condition(firing=True, incident=int(series.steps[0]) - 1)
        alerts = AlertPolicy(for_=1, resolve_after=rule.resolve_after).apply(
            condition, run=batch.run, rank=batch.rank, metric=metric, detector=NonFinite.name,
            severity=rule.severity or NonFinite.severity, steps=series.steps, values=series.values,
            scores=anomalous.astype(np.float64), anomalous=anomalous, now=now,
        )
        signals += [RankSignal(alert=a, world_size=batch.world_size, urgent=True) for a in alerts]
    return signals

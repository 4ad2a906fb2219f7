"""Turning detector decisions into alert transitions: fire once, resolve once, never repeat.

Per condition (one detector on one metric of one rank), like Alertmanager's rules but counted in
steps: fire after ``for_`` consecutive anomalous points, stay firing silently, resolve after
``resolve_after`` consecutive normal points (hysteresis), then stay quiet for ``cooldown`` steps.
The state is a few JSON-able numbers kept with the rank's state, so a replay re-emits nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from rankwatch.contract import Alert, encode_float


@dataclass
class Condition:
    firing: bool = False
    incident: int = 0  # first anomalous step of the current (or last) incident
    streak: int = 0  # consecutive anomalous points
    calm: int = 0  # consecutive normal points while firing
    quiet_until: int = -1  # no new incident before this step (cooldown)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class AlertPolicy:
    for_: int = 1
    resolve_after: int = 5
    cooldown: int = 0

    def apply(
        self,
        cond: Condition,
        *,
        run: str,
        rank: int | None,
        metric: str,
        detector: str,
        severity: str,
        steps: np.ndarray,
        values: np.ndarray,
        scores: np.ndarray,
        anomalous: np.ndarray,
        now: float,
    ) -> list[Alert]:
        """Advance ``cond`` over the points (in order) and return the transitions they cause."""
        alerts = []
        for step, value, score, bad in zip(steps.tolist(), values.tolist(), scores.tolist(), anomalous.tolist()):
            if bad:
                cond.streak += 1
                cond.calm = 0
                if cond.firing or cond.streak < self.for_ or step < cond.quiet_until:
                    continue
                cond.firing, cond.incident = True, step - cond.streak + 1
                status, message = "firing", _describe(detector, metric, rank, step, value)
            else:
                cond.streak = 0
                if not cond.firing:
                    continue
                cond.calm += 1
                if cond.calm < self.resolve_after:
                    continue
                cond.firing, cond.calm, cond.quiet_until = False, 0, step + self.cooldown + 1
                status = "resolved"
                message = f"{metric} on {_who(rank)} back to normal for {self.resolve_after} steps at step {step}"
            alerts.append(
                Alert(
                    key=Alert.make_key(run, detector, metric, rank), run=run, status=status, severity=severity,
                    detector=detector, metric=metric, rank=rank, step=step, value=value, message=message, ts=now,
                    score=score, incident=cond.incident, ranks=() if rank is None else (rank,),
                )
            )
        return alerts


def resolve_retired(cond: Condition, *, run: str, rank: int | None, metric: str, detector: str, severity: str,
                    step: int, value: float, now: float, why: str | None = None) -> Alert:
    """The ``resolved`` transition of a firing condition that nothing will judge again (``why``; by
    default, its rule was removed), so that its alert does not stay open for good."""
    return Alert(
        key=Alert.make_key(run, detector, metric, rank), run=run, status="resolved", severity=severity,
        detector=detector, metric=metric, rank=rank, step=step, value=value, ts=now, score=0.0,
        message=f"{metric} on {_who(rank)}: {why or f'its {detector} rule was removed'}; resolved at step {step}",
        incident=cond.incident, ranks=() if rank is None else (rank,),
    )


def _who(rank: int | None) -> str:
    return "the run" if rank is None else f"rank {rank}"


def _describe(detector: str, metric: str, rank: int | None, step: int, value: float) -> str:
    shown = encode_float(value)
    what = f"{metric} = {shown:.6g}" if isinstance(shown, float) else f"{metric} is {shown}"
    return f"{what} on {_who(rank)} at step {step} ({detector})"

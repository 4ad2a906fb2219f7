"""Turning detector decisions into alert transitions: fire once, resolve once, never repeat.

A condition (one detector on one metric of one rank) fires on its first anomalous point and stays
firing, silently, until ``resolve_after`` consecutive normal points; then it resolves. Its state is
three JSON-able numbers, kept with the rank's other state, so a replay or restart re-emits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankwatch.contract import Alert, encode_float


@dataclass
class Condition:
    firing: bool = False
    incident: int = 0  # step at which the current (or last) incident started
    calm: int = 0  # consecutive normal points while firing

    def to_dict(self) -> dict:
        return {"firing": self.firing, "incident": self.incident, "calm": self.calm}


@dataclass(frozen=True, kw_only=True)
class AlertPolicy:
    resolve_after: int = 5

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
        key = Alert.make_key(run, detector, metric, rank)
        for step, value, score, bad in zip(steps.tolist(), values.tolist(), scores.tolist(), anomalous.tolist()):
            if bad:
                cond.calm = 0
                if cond.firing:
                    continue
                cond.firing, cond.incident = True, step
                status, message = "firing", _describe(detector, metric, rank, step, value)
            elif cond.firing:
                cond.calm += 1
                if cond.calm < self.resolve_after:
                    continue
                cond.firing, cond.calm = False, 0
                status = "resolved"
                message = f"{metric} on {_who(rank)} back to normal for {self.resolve_after} steps at step {step}"
            else:
                continue
            alerts.append(
                Alert(
                    key=key, run=run, status=status, severity=severity, detector=detector, metric=metric,
                    rank=rank, step=step, value=value, message=message, ts=now, score=score,
                    incident=cond.incident,
                )
            )
        return alerts


def _who(rank: int | None) -> str:
    return "all ranks" if rank is None else f"rank {rank}"


def _describe(detector: str, metric: str, rank: int | None, step: int, value: float) -> str:
    shown = encode_float(value)
    what = f"{metric} = {shown:.6g}" if isinstance(shown, float) else f"{metric} is {shown}"
    return f"{what} on {_who(rank)} at step {step} ({detector})"

"""The one interface every detector has (river's habit, vectorised for throughput).

A detector watches one series. ``score(values)`` is pure: an array in [0, 1], higher is more
anomalous, warm-up points score 0. ``learn(values)`` updates state. ``update(values)`` scores each
point against the state before it and then learns it, in order, and is the only call stream code
makes. ``threshold`` turns scores into decisions; detectors never alert (policies do).
State round-trips through ``state_dict()`` / ``from_state()`` as JSON-able numbers, so it fits a
Faust table.

Two detectors read the "values" differently and say so: ``CrossRank`` takes one value per rank at
one step (a row; a 2-D array is a batch of steps) and scores each rank; ``Stall`` scores durations
of silence and adds ``observe(rank, ts)`` / ``check(now)`` for tracking heartbeats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np


class Detector(ABC):
    #: Name used in alert keys and rule files.
    name: str = ""
    #: Scores at or above this are anomalies.
    threshold: float = 0.5
    #: Severity of alerts raised from this detector's decisions.
    severity: str = "warning"
    #: Whether a point is judged against the series' recent values. A rank resumed from an earlier
    #: checkpoint goes back to earlier values, which such a detector takes for a jump (a converged
    #: run's grad norm is orders of magnitude below its early one), so the processor rebuilds it there.
    level_relative: bool = True
    #: Conformance checks that do not apply to this detector, each with the reason.
    skip_checks: Mapping[str, str] = MappingProxyType({})

    @abstractmethod
    def score(self, values: np.ndarray) -> np.ndarray:
        """Score each value against the current state, without changing it."""

    @abstractmethod
    def learn(self, values: np.ndarray) -> None:
        """Fold the values into the state."""

    def update(self, values: np.ndarray) -> np.ndarray:
        """Score each point against everything before it, then learn it."""
        values = np.asarray(values, dtype=np.float64)
        scores = np.empty(len(values))
        for i in range(len(values)):
            scores[i] = self.score(values[i : i + 1])[0]
            self.learn(values[i : i + 1])
        return scores

    def decide(self, scores: np.ndarray) -> np.ndarray:
        return np.asarray(scores) >= self.threshold

    def tail_models(self) -> tuple:
        """The calibration models (``calibration.TailModel``) this detector scores with, for ``calibration.fit_due``."""
        return ()

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Constructor parameters and learned state, JSON-able."""

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Detector:
        return cls(**state)

    def __repr__(self) -> str:
        params = {k: v for k, v in self.state_dict().items() if not isinstance(v, (list, dict))}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in params.items())})"

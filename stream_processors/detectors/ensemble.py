from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.blowup import Blowup
from rankwatch.stream_processors.detectors.calibration import THRESHOLD
from rankwatch.stream_processors.detectors.collapse import Collapse
from rankwatch.stream_processors.detectors.cusum import Cusum
from rankwatch.stream_processors.detectors.ewma import EwmaResidual
from rankwatch.stream_processors.detectors.explode import Explode
from rankwatch.stream_processors.detectors.nonfinite import NonFinite
from rankwatch.stream_processors.detectors.page_hinkley import PageHinkley
from rankwatch.stream_processors.detectors.spike import RobustSpike
from rankwatch.stream_processors.detectors.stall import Stall
from rankwatch.stream_processors.detectors.trend import Plateau, Trend

#: Detectors an ensemble can hold: those that score one series.
MEMBERS: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (NonFinite, RobustSpike, EwmaResidual, Cusum, PageHinkley, Trend, Plateau, Collapse, Blowup, Explode, Stall)
}

#: The general-purpose default: non-finite values at once, spikes and shifts against a rolling (or
#: phase) median, and the same against an exponentially weighted level. ``cusum`` was a member
#: until scores were calibrated: on the varied corpus (``bench/corpus.py``) it alone gave 74 of the
#: ensemble's 81 false positives per 10k clean rows (seasonal, sawtooth and quantised series).
DEFAULT_MEMBERS = ("nonfinite", "spike", "ewma")


def normalise(scores: np.ndarray, threshold: float, target: float = 0.5) -> np.ndarray:
    """Map scores piecewise-linearly so that ``threshold`` becomes ``target`` (0 and 1 stay put)."""
    scores = np.asarray(scores, dtype=np.float64)
    if threshold >= 1.0:  # a detector that only ever scores 0 or 1 (non-finite)
        return np.where(scores >= 1.0, 1.0, target * scores)
    if threshold == target:
        return scores
    return np.where(
        scores < threshold,
        target * scores / threshold,
        target + (1.0 - target) * (scores - threshold) / (1.0 - threshold),
    )


class Ensemble(Detector):
    """Several series detectors as one: a point scores what its most alarmed member says.

    Each member's score is rescaled piecewise-linearly so that its own threshold maps to the
    ensemble's (the calibrated members share the default 0.999999, so their scores pass unchanged),
    and the ensemble scores their maximum: it decides "anomalous" exactly when any member does,
    and a threshold sweep (as NAB's optimiser does) moves all members together. On clean data the
    fraction of points at or above a level is at most the sum of the members' (each calibrated),
    so about 1-2% at 0.99 with the default members. ``members`` lists ``[name, params]`` pairs (or bare names); the default,
    ``nonfinite`` + ``spike`` + ``ewma``, is the general-purpose choice for a series nothing is
    known about: it is what ``rankwatch score-series`` uses unless told otherwise. ``warmup`` is
    the longest member's; a non-finite point scores 1 even then.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = Ensemble()
    >>> x = np.r_[rng.normal(1.0, 0.01, 300), 2.0, rng.normal(1.0, 0.01, 50), np.nan]
    >>> np.flatnonzero(d.decide(d.update(x))).tolist()
    [300, 351]
    """

    name = "ensemble"
    severity = "warning"

    def __init__(self, *, members: Sequence[str | Sequence[Any]] | None = None, threshold: float = THRESHOLD):
        if not 0 < threshold < 1:
            raise ValueError("need 0 < threshold < 1")
        specs = [[m, {}] if isinstance(m, str) else list(m) for m in (DEFAULT_MEMBERS if members is None else members)]
        if not specs:
            raise ValueError("an ensemble needs at least one member")
        self.members: list[Detector] = []
        for spec in specs:
            if len(spec) != 2 or spec[0] not in MEMBERS or not isinstance(spec[1], dict):
                raise ValueError(f"a member is a detector name or [name, params]; names: {', '.join(MEMBERS)}")
            self.members.append(MEMBERS[spec[0]](**spec[1]))
        self.threshold = threshold

    @property
    def warmup(self) -> int:
        return max(int(getattr(m, "warmup", 0)) for m in self.members)

    def _combine(self, per_member: list[np.ndarray]) -> np.ndarray:
        return np.max([normalise(s, m.threshold, self.threshold) for s, m in zip(per_member, self.members)], axis=0)

    def score(self, values: np.ndarray) -> np.ndarray:
        return self._combine([m.score(values) for m in self.members])

    def learn(self, values: np.ndarray) -> None:
        for m in self.members:
            m.learn(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        return self._combine([m.update(values) for m in self.members])

    def tail_models(self) -> tuple:
        return tuple(model for m in self.members for model in m.tail_models())

    def __repr__(self) -> str:
        return f"Ensemble(members={[m.name for m in self.members]!r}, threshold={self.threshold!r})"

    def state_dict(self) -> dict[str, Any]:
        return {"members": [[m.name, m.state_dict()] for m in self.members], "threshold": self.threshold}

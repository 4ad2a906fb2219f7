from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.calibration import THRESHOLD


class Explode(Detector):
    """A value orders of magnitude beyond the series' healthy scale, from the second point on.

    Statistical detectors need a baseline (``spike`` warms up for 20 points), and a run whose
    learning rate is 100 times too large diverges before that: a loss going from 7 to 28,642 at
    step 2 has no history to be an outlier against. This check needs none: the reference is the
    largest magnitude among the last ``window`` healthy points (one point is enough), and a point
    ``factor`` times beyond it is an explosion. The score is ``1 - (1 - threshold) ** (log r /
    log factor)`` for the ratio ``r > 1``: the shared threshold exactly at ``factor``, 0.99 at its
    square root. Exploded points are not learned, so the alert stays firing while the value stays
    blown up; with ``patience > 0`` a new scale that lasts that many points becomes the reference.
    Values near zero (an RL loss that changes sign) are no problem: the reference is the largest
    recent magnitude, not the last one. Non-finite points score 0 (``nonfinite`` owns them).

    Suits loss and grad norm, where a healthy run never jumps a hundredfold.

    Examples
    --------
    >>> d = Explode()
    >>> d.decide(d.update(np.array([7.0, 6.8, 28642.0, 1e5, 9e4]))).tolist()
    [False, False, True, True, True]
    """

    name = "explode"
    severity = "critical"
    skip_checks = {"warmup_scores_zero": "one point is the whole warm-up, so a first spike is the reference"}

    def __init__(
        self,
        *,
        factor: float = 100.0,
        window: int = 16,
        patience: int = 0,
        threshold: float = THRESHOLD,
        floor: float = 1e-12,
        history: Sequence[float] = (),
        run: int = 0,
    ):
        if factor <= 1 or window < 1 or patience < 0 or floor <= 0 or not 0 < threshold < 1:
            raise ValueError("need factor > 1, window >= 1, patience >= 0, floor > 0, 0 < threshold < 1")
        self.factor, self.window, self.patience, self.threshold, self.floor = factor, window, patience, threshold, floor
        self.history = [float(v) for v in history][-window:]  # healthy magnitudes
        self.run = int(run)  # consecutive exploded points

    @property
    def warmup(self) -> int:
        return 1

    def _score_one(self, x: float) -> float:
        if not self.history or not math.isfinite(x):
            return 0.0
        ratio = abs(x) / max(max(self.history), self.floor)
        if ratio <= 1.0:
            return 0.0
        return -math.expm1(math.log1p(-self.threshold) * math.log(ratio) / math.log(self.factor))

    def score(self, values: np.ndarray) -> np.ndarray:
        return np.array([self._score_one(x) for x in np.asarray(values, dtype=np.float64).tolist()])

    def _learn_one(self, x: float, score: float) -> None:
        if not math.isfinite(x):
            return
        if score >= self.threshold:
            self.run += 1
            if not self.patience or self.run < self.patience:
                return
            self.history = []  # the new scale has lasted: it is the reference now
        self.run = 0
        self.history.append(abs(x))
        del self.history[: -self.window]

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        scores = []
        for x in np.asarray(values, dtype=np.float64).tolist():
            s = self._score_one(x)
            self._learn_one(x, s)
            scores.append(s)
        return np.array(scores)

    def state_dict(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "window": self.window,
            "patience": self.patience,
            "threshold": self.threshold,
            "floor": self.floor,
            "history": list(self.history),
            "run": self.run,
        }

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import (
    MAD_TO_SIGMA,
    check_direction,
    directed,
    median_rows,
    standardise,
    tail_sigma,
    trailing_windows,
    z_score,
)


class RobustSpike(Detector):
    """Spikes against a rolling median/MAD: the robust z-score of a point, mapped to [0, 1].

    The median and MAD of the last ``window`` finite points barely move when a few outliers enter,
    unlike mean/std, so one spike cannot hide the next. ``score = 2*Phi(|z| / z_scale) - 1``; the
    default threshold 0.99 with ``z_scale=3`` fires at |z| > 7.7, quiet on the heavy tails of a
    real loss curve. ``min_scale`` keeps a perfectly flat series from scoring its first wiggle as
    infinitely anomalous. ``direction`` ("both", "up" or "down") picks which spikes count: "up"
    suits step time, where only a slow step is a fault. The unit is the larger of the MAD-sigma
    and the sigma implied by the ``tail`` quantile of the window (``(q95 - median) / 1.645`` for
    the default): the same for normal noise, but a series whose bursts are routine (5% of points
    or more, like a busy host's step time) is not flagged at every burst, while an isolated spike
    is. ``tail=0.5`` uses the MAD alone. Non-finite points score 0 here
    (``NonFinite`` owns them) and are not learned.

    Suits any noisy metric with occasional outliers: loss, grad norm, step time, throughput.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = RobustSpike(window=32, warmup=16)
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 40), 5.0])
    >>> bool(d.decide(scores)[-1]), bool(d.decide(scores[:-1]).any())
    (True, False)
    """

    name = "spike"
    severity = "warning"

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 20,
        z_scale: float = 3.0,
        threshold: float = 0.99,
        min_scale: float = 1e-6,
        direction: str = "both",
        tail: float = 0.95,
        history: Sequence[float] = (),
    ):
        if window < 3 or not 2 <= warmup <= window:
            raise ValueError("need window >= 3 and 2 <= warmup <= window")
        if not 0 < threshold < 1 or z_scale <= 0 or min_scale < 0 or not 0.5 <= tail < 1:
            raise ValueError("need 0 < threshold < 1, z_scale > 0, min_scale >= 0, 0.5 <= tail < 1")
        check_direction(direction)
        self.window, self.warmup, self.z_scale = window, warmup, z_scale
        self.threshold, self.min_scale, self.direction, self.tail = threshold, min_scale, direction, tail
        self.history = [float(v) for v in history][-window:]

    def _transform(self, values: np.ndarray) -> np.ndarray:
        """The scale the statistics live on (identity here; ``Blowup`` uses logs)."""
        return values

    def _floor(self, median: np.ndarray) -> np.ndarray:
        return np.maximum(self.min_scale, self.min_scale * np.abs(median))

    def _center_scale(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        median = median_rows(rows)
        mad = median_rows(np.abs(rows - median[:, None])) / MAD_TO_SIGMA
        scale = mad if self.tail <= 0.5 else np.maximum(mad, tail_sigma(rows, median, self.tail, self.direction))
        return median, np.maximum(scale, self._floor(median))

    def _score_rows(self, points: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Score transformed finite ``points``, each against its own row of (transformed) history."""
        center, scale = self._center_scale(rows)
        return z_score(directed(standardise(points, center, scale), self.direction), self.z_scale)

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        scores = np.zeros(len(values))
        finite = np.isfinite(values)
        if len(self.history) >= self.warmup and finite.any():
            rows = np.asarray(self.history)[None, :]
            scores[finite] = self._score_rows(self._transform(values[finite]), rows)
        return scores

    def learn(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.history.extend(self._transform(values[np.isfinite(values)]).tolist())
        del self.history[: -self.window]

    def update(self, values: np.ndarray) -> np.ndarray:
        # History only grows by the finite points, whatever their scores, so every point's
        # trailing window is known up front and the whole batch is scored in one pass.
        values = np.asarray(values, dtype=np.float64)
        finite = np.flatnonzero(np.isfinite(values))
        points = self._transform(values[finite])
        series = np.r_[self.history, points]
        start = len(self.history)
        first = max(start, self.warmup)  # index in ``series`` of the first point past warm-up
        finite_scores = np.zeros(len(points))
        done = first - start
        for rows in trailing_windows(series, self.window, first):
            finite_scores[done : done + len(rows)] = self._score_rows(series[start + done : start + done + len(rows)], rows)
            done += len(rows)
        scores = np.zeros(len(values))
        scores[finite] = finite_scores
        self.history = series[-self.window :].tolist()
        return scores

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "z_scale": self.z_scale,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "tail": self.tail,
            "history": list(self.history),
        }

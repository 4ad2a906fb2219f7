from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.calibration import THRESHOLD, TailModel, half_normal_sf, prior_counts
from rankwatch.stream_processors.detectors.scoring import (
    MAD_TO_SIGMA,
    check_direction,
    directed,
    median_rows,
    standardise,
    tail_sigma,
    trailing_windows,
)

#: Pseudo-points of the half-normal prior a fresh tail model starts from.
PRIOR_WEIGHT = 50.0
#: A point this many robust sigmas off, in the same direction as the ones before it, counts
#: towards a level change (``rebase``).
SHIFT_Z = 4.0


class RobustSpike(Detector):
    """Spikes against a rolling median/MAD, scored by how rare such a deviation is on this series.

    A point's robust z is its distance from the median of the last ``window`` finite points in
    units of their MAD-sigma (or, with ``tail > 0.5``, the sigma implied by the ``tail`` quantile
    of the window if larger). The default is the MAD alone: routine bursts (a busy host's step
    time) are learned by the calibration below, and a unit that widens only when a window happens
    to hold enough bursts makes |z| bimodal and harder to calibrate. The median and MAD
    barely move when a few outliers enter, so one spike cannot hide the next. ``direction``
    ("both", "up" or "down") picks which deviations count.

    The score is calibrated (``calibration.TailModel``): ``1 - P(|z| >= this one)`` under the
    distribution of |z| learned on this series (``memory`` points), so 0.99 means one point in a
    hundred on clean data whatever the metric, and the default threshold 0.9999 one in ten
    thousand. A deviation beyond the threshold is learned only up to the threshold's own quantile:
    a deviation that recurs (an evaluation pause every 50 steps) becomes normal after a few
    occurrences, while one fault does not teach the model that faults are normal.

    After ``rebase`` consecutive points more than 4 sigmas off on the same side, the level has
    changed: the window restarts on those points and re-warms, so a persistent shift is reported
    once, at its start, instead of firing until the median catches up. ``min_scale`` floors the
    unit (absolutely and relative to the median), so a perfectly flat series scores 0 and its
    first real wiggle is reported once. Non-finite points score 0 here (``NonFinite`` owns them)
    and are not learned.

    Suits any noisy metric with occasional outliers: loss, grad norm, step time, throughput.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = RobustSpike(window=32, warmup=16)
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 200), 5.0])
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
        threshold: float = THRESHOLD,
        min_scale: float = 1e-6,
        direction: str = "both",
        tail: float = 0.5,
        memory: int = 1000,
        rebase: int = 8,
        history: Sequence[float] = (),
        calib: Sequence[Any] = (),
        run: int = 0,
    ):
        if window < 3 or not 2 <= warmup <= window:
            raise ValueError("need window >= 3 and 2 <= warmup <= window")
        if not 0 < threshold < 1 or min_scale < 0 or not 0.5 <= tail < 1:
            raise ValueError("need 0 < threshold < 1, min_scale >= 0, 0.5 <= tail < 1")
        if memory < 10 or rebase < 0:
            raise ValueError("need memory >= 10 and rebase >= 0 (0: never)")
        check_direction(direction)
        self.window, self.warmup, self.threshold = window, warmup, threshold
        self.min_scale, self.direction, self.tail = min_scale, direction, tail
        self.memory, self.rebase = memory, rebase
        self.history = [float(v) for v in history][-window:]
        self.run = int(run)  # signed count of consecutive far points on one side
        counts, pending = calib if calib else (prior_counts(half_normal_sf, PRIOR_WEIGHT), [])
        self.calib = TailModel(counts, pending, memory=memory)

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

    def _z_rows(self, points: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Signed robust z of transformed finite ``points``, each against its own row of history."""
        center, scale = self._center_scale(rows)
        return standardise(points, center, scale)

    def _score_z(self, z: float, calib: TailModel) -> float:
        return calib.score(float(directed(np.array([z]), self.direction)[0]))

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        scores = np.zeros(len(values))
        finite = np.isfinite(values)
        if len(self.history) >= self.warmup and finite.any():
            z = self._z_rows(self._transform(values[finite]), np.asarray(self.history)[None, :])
            scores[finite] = [self._score_z(v, self.calib) for v in z.tolist()]
        return scores

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def _learn_z(self, z: float, score: float) -> bool:
        """Fold one post-warm-up z into the tail model and the shift run; True if the level changed."""
        magnitude = float(directed(np.array([z]), self.direction)[0])
        if score >= self.threshold:
            magnitude = min(magnitude, self.calib.quantile(1.0 - self.threshold))
        self.calib.learn(magnitude)  # as TailModel.update does, with the score already known
        if abs(z) < SHIFT_Z or not math.isfinite(z):
            self.run = 0
            return False
        side = 1 if z > 0 else -1
        self.run = self.run + side if self.run * side > 0 else side
        return bool(self.rebase) and abs(self.run) >= self.rebase

    def update(self, values: np.ndarray) -> np.ndarray:
        # The z of every point of a stretch without a level change is known up front (history grows
        # by the finite points whatever their scores), so a stretch is scored in one numpy pass;
        # only the tail model and the shift test go point by point.
        values = np.asarray(values, dtype=np.float64)
        finite = np.flatnonzero(np.isfinite(values))
        points = self._transform(values[finite])
        scores = np.zeros(len(values))
        done = 0
        while done < len(points):
            series = np.r_[self.history, points[done:]]
            start = len(self.history)
            first = max(start, self.warmup)
            z = np.full(len(points) - done, np.nan)
            at = first - start
            for rows in trailing_windows(series, self.window, first):
                z[at : at + len(rows)] = self._z_rows(series[start + at : start + at + len(rows)], rows)
                at += len(rows)
            rebased = None
            for i, zi in enumerate(z.tolist()):
                if zi != zi:  # warm-up
                    continue
                s = self._score_z(zi, self.calib)
                scores[finite[done + i]] = s
                if self._learn_z(zi, s):
                    rebased = i
                    break
            if rebased is None:
                self.history = series[-self.window :].tolist()
                break
            # The level changed: restart the window on the points since the change began.
            upto = done + rebased + 1
            self.history = points[upto - abs(self.run) : upto].tolist()
            self.run, done = 0, upto
        return scores

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "tail": self.tail,
            "memory": self.memory,
            "rebase": self.rebase,
            "history": list(self.history),
            "calib": self.calib.state(),
            "run": self.run,
        }

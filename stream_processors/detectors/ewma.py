from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.calibration import THRESHOLD, TailModel, half_normal_sf, prior_counts
from rankwatch.stream_processors.detectors.recurrence import MARKS, continuations, hold_recurrences
from rankwatch.stream_processors.detectors.runs import SHIFT_Z
from rankwatch.stream_processors.detectors.scoring import (
    check_direction,
    directed,
    directed_one,
    standardise,
    standardise_one,
    written_unit,
)

# For a normal residual, E|r| = sigma * sqrt(2/pi); this turns a mean absolute deviation into a sigma.
_MEAN_ABS_TO_SIGMA = math.sqrt(math.pi / 2.0)


class EwmaResidual(Detector):
    """Residuals from an exponentially weighted mean, in units of an exponentially weighted deviation.

    The level ``mean`` and the mean absolute residual ``dev`` follow the series with weight
    ``alpha`` (about ``2/alpha`` points of memory); during warm-up both are plain running averages.
    Each point's ``z = (x - mean) / (dev * sqrt(pi/2))`` is scored by how rare such a |z| has been
    on this series (``calibration.TailModel``, ``memory`` points): 0.99 is one point in a hundred,
    the default threshold 0.999999 one in a million, whatever the metric. After warm-up
    a residual is clipped to ``clip`` sigmas before it is learned (Huber's estimator): one outlier
    nudges the level by at most ``alpha * clip`` sigmas, yet a real level change is followed within
    a few dozen points. Compared with ``spike`` it needs no window of history (three numbers of
    state) and tracks a drifting series more closely; ``spike`` is more robust on heavy tails.
    ``direction`` is "both", "up" or "down". After ``rebase`` consecutive points more than 4
    sigmas off on one side the level has changed, and the detector re-warms from there (a shift is
    one incident, not ``2/alpha`` flagged points). The sigma is floored at half the smallest step
    between two points seen (the reading's resolution), so a quantised gauge that flickers by one
    unit is not anomalous. As in ``spike``, a shift is news at its first point and an alarm that
    recurs at a fixed spacing is held from its fourth time (``recurrence``). Non-finite points score 0 and are not learned.

    Suits loss, grad norm, throughput, step time ("up").

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = EwmaResidual(alpha=0.1, warmup=20)
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 200), 1.3])
    >>> bool(d.decide(scores)[-1]), bool(d.decide(scores[:-1]).any())
    (True, False)
    """

    name = "ewma"
    severity = "warning"

    def __init__(
        self,
        *,
        alpha: float = 0.1,
        warmup: int = 20,
        threshold: float = THRESHOLD,
        clip: float = 3.0,
        min_scale: float = 1e-6,
        direction: str = "both",
        memory: int = 1000,
        rebase: int = 8,
        count: int = 0,
        mean: float = 0.0,
        dev: float = 0.0,
        calib: Sequence[Any] = (),
        run: int = 0,
        last: float | None = None,
        step: float = 0.0,
        seen: int = 0,
        last_z: float = 0.0,
        marks: Sequence[int] = (),
        last_alarm: int = 0,
        held: bool = False,
    ):
        if not 0 < alpha < 1 or warmup < 2:
            raise ValueError("need 0 < alpha < 1 and warmup >= 2")
        if not 0 < threshold < 1 or clip <= 0 or min_scale < 0 or memory < 10:
            raise ValueError("need 0 < threshold < 1, clip > 0, min_scale >= 0, memory >= 10")
        check_direction(direction)
        self.alpha, self.warmup, self.threshold = alpha, warmup, threshold
        self.clip, self.min_scale, self.direction, self.memory = clip, min_scale, direction, memory
        if rebase < 0:
            raise ValueError("need rebase >= 0 (0: never)")
        self.rebase, self.run = rebase, int(run)
        self.count, self.mean, self.dev = int(count), float(mean), float(dev)
        # The last finite point and the smallest non-zero step seen: the reading's resolution
        # (``scoring.smallest_step``), so a quantised gauge flickering by one unit is not anomalous.
        self.last, self.step = (None if last is None else float(last)), float(step)
        # Points learned, the last one's z, and the alarm episodes (``recurrence``).
        self.seen, self.last_z = int(seen), float(last_z)
        self.marks, self.last_alarm, self.held = [int(m) for m in marks][-MARKS:], int(last_alarm), bool(held)
        counts, pending = calib if calib else (prior_counts(half_normal_sf, 50.0), [])
        self.calib = TailModel(counts, pending, memory=memory)

    def _sigma(self, x: float | None = None) -> float:
        step = self.step
        if not step and x is not None and self.last is not None and x != self.last:
            step = written_unit(self.last, x)  # a reading that never moved: the unit it is written to
        return max(self.dev * _MEAN_ABS_TO_SIGMA, self.min_scale, self.min_scale * abs(self.mean), 0.5 * step)

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if self.count < self.warmup:
            return np.zeros(len(values))
        sigma = self._sigma() if self.step else np.array([self._sigma(x) for x in values.tolist()])
        z = directed(standardise(values, self.mean, sigma), self.direction)
        scores = np.array([self.calib.score(m) for m in z.tolist()])
        scores[~np.isfinite(values)] = 0.0
        return scores

    def _learn_one(self, x: float) -> float:
        """Learn one finite point; return its score (0 during warm-up)."""
        magnitude = None
        residual = x - self.mean if self.count else 0.0
        moved = abs(x - self.last) if self.last is not None else 0.0
        z = 0.0
        if self.count >= self.warmup:
            sigma = self._sigma(x)
            z = standardise_one(x, self.mean, sigma)
            # A far point that continues a far point is held (``recurrence.continuations``).
            held, _ = continuations(np.array([z]), self.last_z, SHIFT_Z)
            magnitude = directed_one(float(held[0]), self.direction)
            residual = min(max(residual, -self.clip * sigma), self.clip * sigma)
            side = 0 if abs(z) < SHIFT_Z else (1 if z > 0 else -1)
            self.run = self.run + side if side and self.run * side > 0 else side
        self.last_z = z if math.isfinite(z) else 0.0
        score = 0.0 if magnitude is None else self.calib.update(magnitude, self.threshold)
        if self.rebase and abs(self.run) >= self.rebase:
            # A new level, confirmed (as ``spike`` scores it): news only on the watched side and
            # if no point of the run was. Then re-warm on it, starting here.
            if directed_one(float(self.run), self.direction) > 0 and not (
                self.marks and self.last_alarm > self.seen - self.rebase
            ):
                score = max(score, 1.0 - self.calib.survival(SHIFT_Z) ** self.rebase)
            self.count, self.dev, self.run, self.last_z = 0, 0.0, 0, 0.0
        if score >= self.threshold:
            held = np.array([score])
            self.marks, _, self.last_alarm, self.held = hold_recurrences(
                held, self.seen, self.threshold, self.rebase, self.marks, self.last_alarm, self.held
            )
            score = float(held[0])
        self.seen += 1
        if not math.isfinite(residual):
            return score  # |x| near the float limit: learning it would poison the state with inf
        if 0.0 < moved < math.inf and (not self.step or moved < self.step):
            self.step = moved
        self.last = x
        weight = max(self.alpha, 1.0 / (self.count + 1))
        self.mean = x if not self.count else self.mean + weight * residual
        # The first point has no residual: averaging a 0 in would understate the deviation.
        if self.count:
            self.dev += max(self.alpha, 1.0 / self.count) * (abs(residual) - self.dev)
        self.count += 1
        return score

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        return np.array([self._learn_one(x) if math.isfinite(x) else 0.0 for x in values.tolist()])

    def tail_models(self) -> tuple[TailModel, ...]:
        return (self.calib,)

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "warmup": self.warmup,
            "threshold": self.threshold,
            "clip": self.clip,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "memory": self.memory,
            "count": self.count,
            "mean": self.mean,
            "dev": self.dev,
            "rebase": self.rebase,
            "calib": self.calib.state(),
            "run": self.run,
            "last": self.last,
            "step": self.step,
            "seen": self.seen,
            "last_z": self.last_z,
            "marks": list(self.marks),
            "last_alarm": self.last_alarm,
            "held": self.held,
        }

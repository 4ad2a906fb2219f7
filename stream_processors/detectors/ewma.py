from __future__ import annotations

import math
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import (
    check_direction,
    directed,
    directed_one,
    standardise,
    standardise_one,
    z_score,
)

# For a normal residual, E|r| = sigma * sqrt(2/pi); this turns a mean absolute deviation into a sigma.
_MEAN_ABS_TO_SIGMA = math.sqrt(math.pi / 2.0)


class EwmaResidual(Detector):
    """Residuals from an exponentially weighted mean, in units of an exponentially weighted deviation.

    The level ``mean`` and the mean absolute residual ``dev`` follow the series with weight
    ``alpha`` (about ``2/alpha`` points of memory); during warm-up both are plain running averages.
    Each point scores ``2*Phi(|z| / z_scale) - 1`` with ``z = (x - mean) / (dev * sqrt(pi/2))``; the
    default threshold 0.999 with ``z_scale=3`` fires at |z| > 9.9 (its mean-absolute scale reacts to
    bursts less than ``spike``'s, so it needs the wider margin to stay as quiet). After warm-up
    a residual is clipped to ``clip`` sigmas before it is learned (Huber's estimator): one outlier
    nudges the level by at most ``alpha * clip`` sigmas, yet a real level change is followed within
    a few dozen points. Compared with ``spike`` it needs no window of history (three numbers of
    state) and tracks a drifting series more closely; ``spike`` is more robust on heavy tails.
    ``direction`` is "both", "up" or "down". Non-finite points score 0 and are not learned.

    Suits loss, grad norm, throughput, step time ("up").

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = EwmaResidual(alpha=0.1, warmup=20)
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 60), 1.3])
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
        z_scale: float = 3.0,
        threshold: float = 0.999,
        clip: float = 3.0,
        min_scale: float = 1e-6,
        direction: str = "both",
        count: int = 0,
        mean: float = 0.0,
        dev: float = 0.0,
    ):
        if not 0 < alpha < 1 or warmup < 2:
            raise ValueError("need 0 < alpha < 1 and warmup >= 2")
        if not 0 < threshold < 1 or z_scale <= 0 or clip <= 0 or min_scale < 0:
            raise ValueError("need 0 < threshold < 1, z_scale > 0, clip > 0, min_scale >= 0")
        check_direction(direction)
        self.alpha, self.warmup, self.z_scale, self.threshold = alpha, warmup, z_scale, threshold
        self.clip, self.min_scale, self.direction = clip, min_scale, direction
        self.count, self.mean, self.dev = int(count), float(mean), float(dev)

    def _sigma(self) -> float:
        return max(self.dev * _MEAN_ABS_TO_SIGMA, self.min_scale, self.min_scale * abs(self.mean))

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if self.count < self.warmup:
            return np.zeros(len(values))
        z = standardise(values, self.mean, self._sigma())
        scores = z_score(directed(z, self.direction), self.z_scale)
        scores[~np.isfinite(values)] = 0.0
        return scores

    def _learn_one(self, x: float) -> float:
        """Learn one finite point; return its deviation before learning (0 during warm-up)."""
        magnitude = 0.0
        residual = x - self.mean if self.count else 0.0
        if self.count >= self.warmup:
            sigma = self._sigma()
            magnitude = directed_one(standardise_one(x, self.mean, sigma), self.direction)
            residual = min(max(residual, -self.clip * sigma), self.clip * sigma)
        if not math.isfinite(residual):
            return magnitude  # |x| near the float limit: learning it would poison the state with inf
        weight = max(self.alpha, 1.0 / (self.count + 1))
        self.mean = x if not self.count else self.mean + weight * residual
        # The first point has no residual: averaging a 0 in would understate the deviation.
        if self.count:
            self.dev += max(self.alpha, 1.0 / self.count) * (abs(residual) - self.dev)
        self.count += 1
        return magnitude

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        magnitudes = [self._learn_one(x) if math.isfinite(x) else 0.0 for x in values.tolist()]
        return z_score(np.array(magnitudes), self.z_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "warmup": self.warmup,
            "z_scale": self.z_scale,
            "threshold": self.threshold,
            "clip": self.clip,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "count": self.count,
            "mean": self.mean,
            "dev": self.dev,
        }

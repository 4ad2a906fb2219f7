from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import ndtr

from stream_processors.detectors.base import Detector

# MAD of a normal sample is 0.6745 sigma; dividing by this makes the robust z comparable to a z-score.
_MAD_TO_SIGMA = 0.6744897501960817


class RobustSpike(Detector):
    """Spikes against a rolling median/MAD: the robust z-score of a point, mapped to [0, 1].

    The median and MAD of the last ``window`` finite points barely move when a few outliers enter,
    unlike mean/std, so one spike cannot hide the next. ``score = 2*Phi(|z| / z_scale) - 1``; the
    default threshold 0.99 with ``z_scale=3`` fires at |z| > 7.7, quiet on the heavy tails of a
    real loss curve. ``min_scale`` keeps a perfectly flat series from scoring its first wiggle as
    infinitely anomalous. Non-finite points score 0 here (``NonFinite`` owns them) and are not learned.

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
        history: Sequence[float] = (),
    ):
        if window < 3 or not 2 <= warmup <= window:
            raise ValueError("need window >= 3 and 2 <= warmup <= window")
        if not 0 < threshold < 1 or z_scale <= 0 or min_scale < 0:
            raise ValueError("need 0 < threshold < 1, z_scale > 0, min_scale >= 0")
        self.window, self.warmup, self.z_scale = window, warmup, z_scale
        self.threshold, self.min_scale = threshold, min_scale
        self.history = [float(v) for v in history][-window:]

    def _z(self, values: np.ndarray) -> np.ndarray:
        hist = np.asarray(self.history)
        median = np.median(hist)
        mad = np.median(np.abs(hist - median)) / _MAD_TO_SIGMA
        scale = max(mad, self.min_scale, self.min_scale * abs(median))
        return (values - median) / scale

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if len(self.history) < self.warmup:
            return np.zeros(len(values))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            z = self._z(values)  # a zero scale (min_scale=0, flat history) gives ±inf or 0/0
        z = np.nan_to_num(z, nan=0.0, posinf=np.inf, neginf=-np.inf)
        scores = 2.0 * ndtr(np.abs(z) / self.z_scale) - 1.0  # ndtr(inf) = 1: the biggest spikes score 1
        scores[~np.isfinite(values)] = 0.0
        return scores

    def learn(self, values: np.ndarray) -> None:
        finite = np.asarray(values, dtype=np.float64)
        self.history.extend(finite[np.isfinite(finite)].tolist())
        del self.history[: -self.window]

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "z_scale": self.z_scale,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "history": list(self.history),
        }

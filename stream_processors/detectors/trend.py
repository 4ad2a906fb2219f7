from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from scipy.special import ndtr, ndtri

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import MAD_TO_SIGMA, check_direction, median_rows, ratio_score


class WindowTrend(NamedTuple):
    """Mann–Kendall and Theil–Sen statistics of one window, as scipy defines them."""

    s: float  # Kendall's S: concordant minus discordant pairs against time
    z: float  # S over its tie-corrected standard deviation (scipy.stats.kendalltau, "asymptotic")
    slope: float  # Theil–Sen slope per point (scipy.stats.theilslopes)
    low_slope: float  # its confidence interval at the given alpha (Sen 1968, as scipy computes it)
    high_slope: float
    sigma: float  # MAD-sigma of the residuals around the Theil–Sen line
    level: float  # median of the window


@lru_cache(maxsize=8)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    i, j = np.triu_indices(n, 1)
    return i, j, (j - i).astype(np.float64)


def window_trend(y: np.ndarray, alpha: float) -> WindowTrend:
    """Mann–Kendall S with its z, and the Theil–Sen slope with its ``1 - alpha`` interval.

    The same numbers as ``scipy.stats.kendalltau(t, y, method="asymptotic")`` and
    ``scipy.stats.theilslopes(y, alpha=1 - alpha)`` (tests check it), from one set of pairwise
    differences: scipy recomputes them per call and costs ~20x more, and a streaming detector
    evaluates a window at every point.
    """
    n = len(y)
    i, j, dt = _pairs(n)
    dy = y[j] - y[i]
    s = float(np.count_nonzero(dy > 0) - np.count_nonzero(dy < 0))
    ordered = np.sort(y)
    if np.any(ordered[1:] == ordered[:-1]):
        _, counts = np.unique(ordered, return_counts=True)
        ties = counts[counts > 1].astype(np.float64)
        tied = float(np.sum(ties * (ties - 1) * (2 * ties + 5)))
    else:
        tied = 0.0
    var = (n * (n - 1) * (2 * n + 5) - tied) / 18.0
    z = s / math.sqrt(var) if var > 0 else 0.0
    slopes = dy / dt
    m = len(slopes)
    spread = -ndtri(alpha / 2.0) * math.sqrt(max(var, 0.0))
    upper = min(int(np.round((m + spread) / 2.0)), m - 1)
    lower = max(int(np.round((m - spread) / 2.0)) - 1, 0)
    # Four order statistics of the slopes: the median and scipy's interval ranks (its Rl and Ru).
    ranks = sorted({lower, (m - 1) // 2, m // 2, upper})
    part = np.partition(slopes, ranks)
    slope = float(0.5 * (part[(m - 1) // 2] + part[m // 2]))
    low_slope, high_slope = float(part[lower]), float(part[upper])
    resid = y - slope * np.arange(n)
    level = float(ordered[(n - 1) // 2] + ordered[n // 2]) * 0.5
    center = median_rows(resid[None, :])
    sigma = float(median_rows(np.abs(resid - center)[None, :])[0]) / MAD_TO_SIGMA
    return WindowTrend(s, z, slope, low_slope, high_slope, sigma, level)


class Trend(Detector):
    """A sustained trend over the last ``window`` points: Mann–Kendall significance and Theil–Sen size.

    Each point closes a window of the last ``window`` finite points. It scores ``min(sig, size)``:
    ``sig = 1 / (1 + p / alpha)`` from the one-sided Mann–Kendall p-value in the watched
    ``direction`` ("up", "down" or "both"), and ``size = 1 - 2**(-(c / min_change)**2)`` where ``c``
    is the Theil–Sen change across the window in units of the residual noise (MAD-sigma around
    the Theil–Sen line). Both halves are 0.5 at their limit, so the default threshold 0.5 means
    "significant at ``alpha`` and at least ``min_change`` sigmas of change": a tiny but
    significant slope on a long quiet series does not alert, nor does a big but noisy wander.

    For a training run: a loss with ``direction="up"`` (divergence, a slowly rising loss after a
    bad learning-rate change), a reward or accuracy with ``direction="down"``, grad norm "up".
    ``Plateau`` is the converse: a metric that should keep improving and has stopped.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = Trend(direction="up")
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 100), 1.0 + 0.002 * np.arange(1, 41)])
    >>> bool(d.decide(scores[:100]).any()), bool(d.decide(scores[100:]).any())
    (False, True)
    """

    name = "trend"
    severity = "warning"
    skip_checks = {"spike_outscores_normal": "a trend detector answers sustained change, not one outlier"}

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 32,
        alpha: float = 0.001,
        min_change: float = 3.0,
        threshold: float = 0.5,
        min_scale: float = 1e-6,
        direction: str = "up",
        history: Sequence[float] = (),
    ):
        if window < 5 or not 4 <= warmup < window:
            raise ValueError("need window >= 5 and 4 <= warmup < window")
        if not 0 < alpha < 0.5 or min_change <= 0 or min_scale < 0 or not 0 < threshold < 1:
            raise ValueError("need 0 < alpha < 0.5, min_change > 0, min_scale >= 0, 0 < threshold < 1")
        self._check_direction(direction)
        self.window, self.warmup, self.alpha, self.min_change = window, warmup, alpha, min_change
        self.threshold, self.min_scale, self.direction = threshold, min_scale, direction
        self.history = [float(v) for v in history][-(window - 1) :]

    def _check_direction(self, direction: str) -> None:
        check_direction(direction)

    def _window_score(self, stats: WindowTrend, n: int) -> float:
        sigma = max(stats.sigma, self.min_scale, self.min_scale * abs(stats.level))
        change = stats.slope * (n - 1) / sigma
        scores = []
        for side, sign in (("up", 1.0), ("down", -1.0)):
            if self.direction in (side, "both"):
                p = float(ndtr(-sign * stats.z))
                sig = 1.0 / (1.0 + p / self.alpha)
                size = float(ratio_score(max(sign * change, 0.0) / self.min_change))
                scores.append(min(sig, size))
        return max(scores)

    def _score_one(self, x: float) -> float:
        if not math.isfinite(x) or len(self.history) < self.warmup:
            return 0.0
        y = np.array([*self.history, x])
        return self._window_score(window_trend(y, self.alpha), len(y))

    def score(self, values: np.ndarray) -> np.ndarray:
        return np.array([self._score_one(x) for x in np.asarray(values, dtype=np.float64).tolist()])

    def learn(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.history.extend(values[np.isfinite(values)].tolist())
        del self.history[: -(self.window - 1)]

    def update(self, values: np.ndarray) -> np.ndarray:
        scores = []
        for x in np.asarray(values, dtype=np.float64).tolist():
            scores.append(self._score_one(x))
            if math.isfinite(x):
                self.history.append(x)
                del self.history[: -(self.window - 1)]
        return np.array(scores)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "alpha": self.alpha,
            "min_change": self.min_change,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "history": list(self.history),
        }


class Plateau(Trend):
    """A metric that should keep improving and has stopped: even the best case is too little progress.

    Over the last ``window`` points, the Theil–Sen confidence interval (level ``1 - alpha``) bounds
    the slope; the most optimistic end of it in the ``improving`` direction ("down" for a loss,
    "up" for an accuracy or reward), times the window, is the most progress the data allow. If
    that is below ``tolerance`` times the metric's level, the run has plateaued (or got worse):
    the score is ``1 - 2**(-(allowed / best_case)**2)``, 0.5 (the threshold) at equality. It is an
    ``info`` signal: late in training a plateau is expected, early on it is wasted compute. A
    long window and a loose ``alpha`` suit it; cost grows with ``window**2`` per point.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> t = np.arange(400)
    >>> loss = np.where(t < 200, 2.0 - 0.004 * t, 1.2) + rng.normal(0.0, 0.01, 400)
    >>> d = Plateau(window=100, warmup=80)
    >>> flagged = np.flatnonzero(d.decide(d.update(loss)))
    >>> bool(flagged.min() > 200), len(flagged) > 100
    (True, True)
    """

    name = "plateau"
    severity = "info"
    skip_checks = {"spike_outscores_normal": "a plateau detector answers missing progress, not one outlier"}

    def __init__(
        self,
        *,
        window: int = 200,
        warmup: int = 150,
        alpha: float = 0.05,
        tolerance: float = 0.01,
        threshold: float = 0.5,
        min_scale: float = 1e-6,
        improving: str = "down",
        history: Sequence[float] = (),
    ):
        if improving not in ("up", "down"):
            raise ValueError(f"improving must be 'up' or 'down', not {improving!r}")
        if tolerance <= 0:
            raise ValueError("need tolerance > 0")
        super().__init__(
            window=window, warmup=warmup, alpha=alpha, min_change=1.0, threshold=threshold,
            min_scale=min_scale, direction="both", history=history,
        )
        self.tolerance, self.improving = tolerance, improving
        del self.min_change, self.direction

    def _window_score(self, stats: WindowTrend, n: int) -> float:
        best = -stats.low_slope if self.improving == "down" else stats.high_slope
        best_case = max(best, 0.0) * (n - 1)
        allowed = max(self.tolerance * abs(stats.level), self.min_scale)
        return 1.0 if best_case == 0.0 else float(ratio_score(allowed / best_case))

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "alpha": self.alpha,
            "tolerance": self.tolerance,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "improving": self.improving,
            "history": list(self.history),
        }
